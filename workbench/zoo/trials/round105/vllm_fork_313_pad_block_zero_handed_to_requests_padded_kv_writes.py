"""Habana vLLM fork (HPU graphs): decode batches are padded to a graph bucket with dummy sequences whose KV writes go to block 0, the padding block, but the block allocators still hand block 0 to a real request, so every padded replay overwrites that request's first cached tokens.

Upstream: https://github.com/HabanaAI/vllm-fork/pull/313 ("Removed padding block from a list of available blocks in
allocators", HabanaAI/vllm-fork, by Tomasz Zielinski, merged 2024-09-23 into habana_main as commit 63fae5106; the same
change was opened as #312). Read: the commit's diff (``vllm/core/block/cpu_gpu_block_allocator.py``
``CpuGpuBlockAllocator.create`` and ``vllm/core/block_manager_v1.py`` ``UncachedBlockAllocator.__init__`` start their
block ids at ``reserved_blocks = 1 if is_hpu() else 0``) and, at the parent commit f92ffc15d, in
``vllm/worker/habana_model_runner.py``: ``_PAD_SLOT_ID = 0`` / ``_PAD_BLOCK_ID = 0``, ``find_bucket``, ``warmup_range``,
``prepare_input_tensors`` (batch padding with ``create_dummy_seq_group_metadata(0, 0, is_prompt)``), ``_prepare_decode``
(``dummy_slots = itertools.cycle(range(_PAD_SLOT_ID, _PAD_SLOT_ID + block_size))`` for sequences whose block table is
empty, ``block_list`` / ``block_mapping`` / ``block_usage`` flattening and bucket padding), ``warmup_scenario``,
``HpuModelAdapter._set_block_mapping``; ``vllm/attention/backends/habana_attn.py`` ``HabanaAttentionImpl.forward``
(``prepare_to_cache`` then ``k_cache``/``v_cache`` writes, ``prompt_attention`` / ``flat_pa``);
``vllm/core/block/naive_block.py`` (``_free_block_indices = deque(block_ids)``, ``popleft`` on allocation).
Symptom: on Gaudi with HPU graphs, whenever a decode batch is padded to its bucket the request that owns block 0 (with
block manager v2 the first request served) generates degraded text; no error.
Mechanism: the HPU runner pads every decode batch up to a bucket (the shapes the HPU graphs were captured for) with dummy
sequences. A dummy sequence has an empty block table, so ``_prepare_decode`` gives it a slot from ``dummy_slots``, i.e.
block 0 (``_PAD_BLOCK_ID``), and the replay writes the dummy token's K/V there. Block 0 is meant to be a scratch
block, but ``CpuGpuBlockAllocator.create`` puts it in the free list and the naive allocator hands it out first: the
padded rows overwrite positions 0.. of a live request, whose attention reads them in the same step and every later one.
The unpadded reference never writes there.
Doctor: stale-padding, at create. Real rows depend on what the padded rows hold: the dummy rows' K/V land in a block the
allocator ``create`` gave to a real request.
Fix (upstream): reserve block 0 for padding on HPU: the allocators' block ids start at 1 (one GPU block fewer).
Modelled: ``NaiveBlockAllocator`` (deque, ``popleft``) and ``CpuGpuBlockAllocator.create`` as read; ``find_bucket``,
``warmup_range``, ``create_dummy_seq_group_metadata``, ``_prepare_decode`` (no LoRA, no sliding window),
``_set_block_mapping`` (one-hot ``block_mapping``, ``block_usage`` bias), the KV write (``index_put_`` at
``slot // block_size, slot % block_size``) and the decode bucket graph (warm-up scenario of dummy sequences with
``_PAD_BLOCK_ID`` tables, capture, copy-in, replay). Stand-ins: a 2-layer decoder (RMSNorm, qkv, learned positions
instead of RoPE, gated MLP); ``flat_pa`` as torch ops (one global max shift instead of the per-block max);
``BlockSpaceManager`` reduced to "allocate blocks as a sequence grows"; prompts fill their bucket and run unpadded
without a graph (only the decode bucket bs 4 x 8 blocks is captured); decode tokens are fixed in advance (no sampler);
the reference is the same model on the real rows only (no bucket padding, no graphs); float64.
Workload: block size 4, 12 GPU blocks, decode buckets bs 4 and 4/8 blocks. A and B prefill 8 tokens each (bug: A gets
blocks 0-1, B 2-3; fix: A 1-2, B 3-4), then three decode steps of [A, B], each padded with two dummy rows (slots 0 and
1) and served by the captured (4, 8) graph. Bug: prefill and B's logits equal eager; A's logits differ from the first
decode step on (the dummy rows' K/V sit at A's positions 0-1): 1.51, 2.56, 9.96 in steps 1-3, max |graph - eager| = 9.96.
Fix: A's blocks start at 1, the dummy rows write the reserved block 0; equals eager (max 8.0e-15, float64 rounding).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections import deque

import torch
import torch.nn.functional as F

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/HabanaAI/vllm-fork/pull/313"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "create"
SYMPTOM = ("HPU-graph decode batches padded with dummy sequences write their K/V into block 0, which the block "
           "allocator also gives to a real request: that request's cached tokens are overwritten on every padded step")

VOCAB, HIDDEN, N_HEADS, HEAD_DIM, INTER, N_LAYERS, MAX_POS = 32, 16, 2, 8, 24, 2, 32
BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_NUM_SEQS = 4, 12, 4
DTYPE = torch.float64

_PAD_SLOT_ID = 0
_PAD_BLOCK_ID = 0

_variant = "bug"


def is_hpu() -> bool:
    return True                                     # this runner models the Gaudi path


# --- vllm/core/block/naive_block.py, cpu_gpu_block_allocator.py (reduced) -------------------------------------------

class NaiveBlockAllocator:
    def __init__(self, num_blocks, block_size, block_ids):
        self._free_block_indices = deque(block_ids)
        self._all_block_indices = frozenset(block_ids)
        assert len(self._all_block_indices) == num_blocks
        self._block_size = block_size

    def _allocate_block_id(self) -> int:
        if not self._free_block_indices:
            raise RuntimeError("NoFreeBlocksError")
        return self._free_block_indices.popleft()

    @property
    def all_block_ids(self):
        return self._all_block_indices


class CpuGpuBlockAllocator:
    @staticmethod
    def create(allocator_type: str, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int):
        if _variant == "bug":
            block_ids = list(range(num_gpu_blocks + num_cpu_blocks))
        else:
            # For HPU, block id 0 is used only for padding
            reserved_blocks = 1 if is_hpu() else 0
            block_ids = list(range(reserved_blocks, num_gpu_blocks + num_cpu_blocks))
            num_gpu_blocks -= reserved_blocks
        gpu_block_ids = block_ids[:num_gpu_blocks]
        cpu_block_ids = block_ids[num_gpu_blocks:]
        assert allocator_type == "naive"
        gpu_allocator = NaiveBlockAllocator(num_gpu_blocks, block_size, gpu_block_ids)
        cpu_allocator = NaiveBlockAllocator(num_cpu_blocks, block_size, cpu_block_ids)
        return CpuGpuBlockAllocator(cpu_allocator, gpu_allocator)

    def __init__(self, cpu_block_allocator, gpu_block_allocator):
        assert not (cpu_block_allocator.all_block_ids & gpu_block_allocator.all_block_ids)
        self._allocators = {"cpu": cpu_block_allocator, "gpu": gpu_block_allocator}

    def allocate_block_id(self, device="gpu") -> int:
        return self._allocators[device]._allocate_block_id()


@dataclasses.dataclass
class SequenceGroupMetadata:                        # one sequence per group
    request_id: str
    is_prompt: bool
    token_ids: list
    block_table: list


class BlockSpaceManager:                            # stand-in: blocks as a sequence grows
    def __init__(self, allocator):
        self.allocator = allocator

    def ensure_slots(self, seq: SequenceGroupMetadata):
        while len(seq.block_table) * BLOCK_SIZE < len(seq.token_ids):
            seq.block_table.append(self.allocator.allocate_block_id("gpu"))


# --- vllm/worker/habana_model_runner.py (reduced) -------------------------------------------------------------------

def warmup_range(config):
    bmin, bstep, bmax = config
    ramp_up_acc = itertools.accumulate(itertools.repeat(2), func=operator.mul, initial=bmin)
    ramp_up_tw = itertools.takewhile(lambda x: x < bstep and x <= bmax, ramp_up_acc)
    buckets = list(ramp_up_tw) + list(range(bstep, bmax + 1, bstep))
    return [b for b in buckets if b >= bmin]


def next_pow2(value, base):
    res = base
    while value > 1:
        value = (value + 1) // 2
        res *= 2
    return res


def find_bucket(value, config):
    bmin, bstep, _ = config
    return max(bmin, min((value + bstep - 1) // bstep * bstep, next_pow2(value, bmin)))


def pad_list(lst, k, v):
    target_len = (len(lst) + k - 1) // k * k
    return lst + [v] * (target_len - len(lst))


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def flat_pa(query, key_cache, value_cache, block_list, block_mapping, block_bias, scale):
    """vllm_hpu_extension ``ops.flat_pa`` as torch ops: queries go to their blocks (batch2block), scores per block slot
    masked by ``block_bias``, softmax across a row's blocks, block2batch by the one-hot ``block_mapping``."""
    batch = query.size(0)
    q = torch.matmul(block_mapping, query.flatten(1)).view(-1, N_HEADS, HEAD_DIM)
    keys, values = key_cache.index_select(0, block_list), value_cache.index_select(0, block_list)
    attn = torch.einsum("nhd,nshd->nhs", q, keys) * scale + block_bias.unsqueeze(1)
    p = (attn - attn.amax()).exp()
    sums = torch.matmul(block_mapping.t(), p.sum(-1))                              # [batch, heads]
    out = torch.matmul(block_mapping.t(), torch.einsum("nhs,nshd->nhd", p, values).flatten(1))
    return out.view(batch, N_HEADS, HEAD_DIM) / sums.clamp_min(1e-300).unsqueeze(-1)


class DecoderLayer:
    def __init__(self, gen, device):
        r = lambda *s, scale=0.4: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.qkv, self.o = r(3 * N_HEADS * HEAD_DIM, HIDDEN), r(HIDDEN, N_HEADS * HEAD_DIM)
        self.gate_up, self.down = r(2 * INTER, HIDDEN), r(HIDDEN, INTER)
        self.in_norm, self.post_norm = 1.0 + r(HIDDEN, scale=0.1), 1.0 + r(HIDDEN, scale=0.1)

    def attention(self, h, kv_cache, meta):                # HabanaAttentionImpl.forward
        batch_size, seq_len, _ = h.shape
        q, k, v = F.linear(rms_norm(h, self.in_norm), self.qkv).view(-1, 3, N_HEADS, HEAD_DIM).unbind(1)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        slots = meta["slot_mapping"].flatten()               # cache_ops.prepare_to_cache + VLLMKVCache
        indices, offsets = torch.div(slots, BLOCK_SIZE, rounding_mode="floor"), slots % BLOCK_SIZE
        key_cache.index_put_((indices, offsets), k)
        value_cache.index_put_((indices, offsets), v)
        scale = HEAD_DIM ** -0.5
        if meta["is_prompt"]:                                # ops.prompt_attention with attn_bias
            shape = (batch_size, seq_len, N_HEADS, HEAD_DIM)
            qh, kh, vh = (x.view(shape).transpose(1, 2) for x in (q, k, v))
            scores = qh @ kh.transpose(-1, -2) * scale + meta["attn_bias"]
            out = (scores.softmax(-1) @ vh).transpose(1, 2)
        else:
            out = flat_pa(q, key_cache, value_cache, meta["block_list"], meta["block_mapping"], meta["attn_bias"],
                          scale)
        return F.linear(out.reshape(batch_size, seq_len, -1), self.o)

    def forward(self, h, kv_cache, meta):
        h = h + self.attention(h, kv_cache, meta)
        gate, up = F.linear(rms_norm(h, self.post_norm), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class LlamaModel:
    def __init__(self, device):
        gen = generator(313)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.embed_positions = randn(MAX_POS, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE)
        self.layers = [DecoderLayer(gen, device) for _ in range(N_LAYERS)]
        self.norm = 1.0 + randn(HIDDEN, gen=gen, device=device, scale=0.1).to(DTYPE)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids, positions, kv_caches, meta):
        h = self.embed_tokens[input_ids] + self.embed_positions[positions]
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer.forward(h, kv_cache, meta)
        return rms_norm(h, self.norm)

    def compute_logits(self, hidden_states):
        return F.linear(hidden_states, self.lm_head)


class HpuModelAdapter:
    def __init__(self, model):
        self.model = model

    def _set_attn_bias(self, meta, batch_size, seq_len, device):
        len_mask = (torch.arange(seq_len, device=device).view(1, seq_len)
                    .ge(meta["seq_lens_tensor"].unsqueeze(-1)).view(batch_size, 1, 1, seq_len))
        causal_mask = torch.triu(torch.ones(batch_size, 1, seq_len, seq_len, dtype=torch.bool, device=device), 1)
        mask = causal_mask.logical_or(len_mask)
        return dict(meta, attn_bias=torch.zeros_like(mask, dtype=DTYPE).masked_fill_(mask, -math.inf))

    def _set_block_mapping(self, meta, batch_size, device):
        mask = torch.arange(BLOCK_SIZE, device=device, dtype=torch.int32).unsqueeze(0)
        mask = mask >= meta["block_usage"].unsqueeze(-1)
        attn_bias = torch.zeros_like(mask, dtype=DTYPE).masked_fill_(mask, -math.inf)
        # F.one_hot(block_mapping, num_classes=batch_size), written as a comparison (one_hot checks its range on the host)
        block_mapping = (meta["block_mapping"].unsqueeze(-1) == torch.arange(batch_size, device=device)).to(DTYPE)
        return dict(meta, block_mapping=block_mapping, attn_bias=attn_bias)

    def forward(self, input_ids, positions, kv_caches, meta):
        batch_size, seq_len = input_ids.shape
        meta = (self._set_attn_bias(meta, batch_size, seq_len, input_ids.device) if meta["is_prompt"]
                else self._set_block_mapping(meta, batch_size, input_ids.device))
        return self.model.forward(input_ids, positions, kv_caches, meta)


class HPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = HpuModelAdapter(LlamaModel(device))
        self.kv_caches = [torch.zeros(2, NUM_GPU_BLOCKS, BLOCK_SIZE, N_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                          for _ in range(N_LAYERS)]
        self.decode_bs_bucket_cfg = (MAX_NUM_SEQS, MAX_NUM_SEQS, MAX_NUM_SEQS)
        self.decode_block_bucket_cfg = (4, 4, 8)
        self.graphs = {}
        if not enforce_eager:
            self.warmup_graphs([(MAX_NUM_SEQS, 8)])

    def create_dummy_seq_group_metadata(self, group_id, seq_len, is_prompt):
        num_blocks = math.ceil(seq_len / BLOCK_SIZE)
        input_len, output_len = (seq_len, 0) if is_prompt else (seq_len - 1, 1)
        return SequenceGroupMetadata(str(group_id), is_prompt, [0] * max(input_len, 0) + [1] * output_len,
                                     None if is_prompt else [_PAD_BLOCK_ID] * num_blocks)

    def _prepare_decode(self, seqs):
        input_tokens, input_positions, slot_mapping, block_tables = [], [], [], []
        dummy_slots = itertools.cycle(range(_PAD_SLOT_ID, _PAD_SLOT_ID + BLOCK_SIZE))
        for seq in seqs:
            position = len(seq.token_ids) - 1
            input_tokens.append([seq.token_ids[-1]])
            input_positions.append([position])
            block_table = seq.block_table
            block_number = _PAD_BLOCK_ID if len(block_table) == 0 else block_table[position // BLOCK_SIZE]
            if block_number == _PAD_BLOCK_ID:
                slot = next(dummy_slots)
            else:
                slot = block_number * BLOCK_SIZE + position % BLOCK_SIZE
            slot_mapping.append([slot])
            block_tables.append(block_table)
        blocks_used = [len(bt) for bt in block_tables if bt]
        block_list = list(itertools.chain(*block_tables))
        block_mapping = list(itertools.chain.from_iterable([i] * b_u for i, b_u in enumerate(blocks_used)))
        last_block = [sl % BLOCK_SIZE + 1 for sl in itertools.chain(*slot_mapping)]
        block_usage = list(itertools.chain(*[[BLOCK_SIZE] * (b_u - 1) + [lb]
                                              for b_u, lb in zip(blocks_used, last_block)]))
        if not self.enforce_eager:                       # bucket the flattened block list for the HPU graph
            block_bucket_size = find_bucket(len(block_list), self.decode_block_bucket_cfg)
            block_list = pad_list(block_list, block_bucket_size, _PAD_SLOT_ID)
            block_mapping = pad_list(block_mapping, block_bucket_size, 0)
            block_usage = pad_list(block_usage, block_bucket_size, 0)
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)   # noqa: E731
        return dict(input_ids=t(input_tokens, torch.long), positions=t(input_positions, torch.long),
                    slot_mapping=t(slot_mapping, torch.long), block_list=t(block_list, torch.long),
                    block_mapping=t(block_mapping, torch.long), block_usage=t(block_usage, DTYPE))

    def warmup_graphs(self, buckets):                    # warmup_scenario(bs, num_blocks, is_prompt=False) + capture
        for batch_size, num_blocks in buckets:
            blocks = [num_blocks // batch_size] * batch_size
            blocks[0] += num_blocks % batch_size
            seqs = [self.create_dummy_seq_group_metadata(i, b * BLOCK_SIZE - 1, False) for i, b in enumerate(blocks)]
            static = self._prepare_decode(seqs)

            def forward(s=static):
                meta = dict(is_prompt=False, slot_mapping=s["slot_mapping"], block_list=s["block_list"],
                            block_mapping=s["block_mapping"], block_usage=s["block_usage"])
                return self.model.forward(s["input_ids"], s["positions"], self.kv_caches, meta)

            state = {f"kv_caches[{i}]": c for i, c in enumerate(self.kv_caches)}
            g, out = capture(forward, device=self.device, warmups=2, static=static, state=state,
                             owner="HPUModelRunner", name=f"hpu graph decode bs{batch_size} blocks{num_blocks}")
            self.graphs[(batch_size, num_blocks)] = (g, static, out)

    def execute_decode(self, seqs):
        real_batch_size = len(seqs)
        seqs = list(seqs)
        if not self.enforce_eager:                       # prepare_input_tensors: pad the batch to its bucket
            batch_size_padded = find_bucket(real_batch_size, self.decode_bs_bucket_cfg)
            seqs += [self.create_dummy_seq_group_metadata(0, 0, False)
                     for _ in range(batch_size_padded - real_batch_size)]
        inputs = self._prepare_decode(seqs)
        key = (len(seqs), inputs["block_list"].numel())
        if key in self.graphs:                           # _use_graphs
            g, static, out = self.graphs[key]
            for name, t in inputs.items():
                static[name].copy_(t)
            hidden = replay(g, out, real=real_batch_size, size=len(seqs))
        else:
            meta = dict(is_prompt=False, slot_mapping=inputs["slot_mapping"], block_list=inputs["block_list"],
                        block_mapping=inputs["block_mapping"], block_usage=inputs["block_usage"])
            hidden = self.model.forward(inputs["input_ids"], inputs["positions"], self.kv_caches, meta)
        return self.model.model.compute_logits(hidden[:real_batch_size, -1].clone())

    def execute_prompt(self, seqs):                      # prompts fill their (bs, seq) bucket: no padding here
        slot_mapping = [[s.block_table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(s.token_ids))]
                        for s in seqs]
        t = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)   # noqa: E731
        input_ids = t([s.token_ids for s in seqs])
        seq_len = input_ids.shape[1]
        meta = dict(is_prompt=True, slot_mapping=t(slot_mapping), seq_lens_tensor=t([len(s.token_ids) for s in seqs]))
        hidden = self.model.forward(input_ids, t([list(range(seq_len))] * len(seqs)), self.kv_caches, meta)
        return self.model.model.compute_logits(hidden[:, -1])


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(3130)
    prompts = {name: torch.randint(2, VOCAB, (8,), generator=gen).tolist() for name in "AB"}
    decode_tokens = torch.randint(2, VOCAB, (3, 2), generator=gen).tolist()

    def serve(enforce_eager: bool):
        runner = HPUModelRunner(device, enforce_eager)
        block_manager = BlockSpaceManager(CpuGpuBlockAllocator.create("naive", NUM_GPU_BLOCKS, 0, BLOCK_SIZE))
        seqs = [SequenceGroupMetadata(name, True, list(prompts[name]), []) for name in "AB"]
        for seq in seqs:
            block_manager.ensure_slots(seq)
        outs = [runner.execute_prompt(seqs)]
        for step_tokens in decode_tokens:
            for seq, token in zip(seqs, step_tokens):
                seq.is_prompt = False
                seq.token_ids.append(token)
                block_manager.ensure_slots(seq)
            outs.append(runner.execute_decode(seqs))
        return outs

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
