"""ACL-graph decode: padded rows keep the previous step's slot indices, so replay writes junk K/V into a reused slot.

Upstream: https://github.com/DeepLink-org/dlinfer/pull/306 ("fix padding", commit c5d43a905834e48eb978c073084304cdec18278b,
March 2026); file dlinfer/framework/lmdeploy_ext/cudagraph/ascend_cudagraph.py (lmdeploy's Ascend graph mode).
Symptom: no user report (the commit says "fix padding"); from the code: when a decode batch is padded up to the
captured bucket, the padded rows of the replayed ACL graph write K/V into KV-cache slots that an earlier, larger
batch left in the buffers. Once such a slot has been freed and handed to a new request, that request's cached
K/V is silently overwritten and its outputs go wrong; eager mode (no padded rows) is right.
Mechanism: ``AscendSingleGraphRunner.capture`` calls ``AscendCudaGraphMixin_make_buffers_cudagraph`` once per
bucket: persistent ``input_ids``/``position_ids`` (``torch.empty``), ``block_offsets`` (zeros), ``kv_seqlens``,
``kv_start_indices`` (``-torch.ones``: -1 = "do not write this row") sized for the bucket. Before every replay
``AscendSingleGraphRunner.forward`` calls ``AscendCudaGraphMixin_fill_buffers_cudagraph``, which before the fix
wrote only the live prefix (``input_buffers["kv_start_indices"][:batch_size] = kv_start_indices``, likewise
``input_ids``/``position_ids[:, :num_tokens]``, ``block_offsets[:batch_size, :num_blocks]``, ``kv_seqlens``,
``x_active_mask``) and never reset rows ``[batch_size, bucket)``. Inside the graph ``fill_kv_cache``
(dlinfer/vendor/ascend/torch_npu_ops.py, ``atb._npu_reshape_and_cache(slot_indices=kv_indices)``) scatters the
K/V of every bucket row to its slot. So after a bucket-4 step with 4 requests, a step with 3 requests replays
row 3 with the old request's token, position and slot: that request finished, its block went back to the free
list and was given to a new request whose prompt K/V now lives in that slot -- the padded row overwrites it,
and the new request's attention reads the junk from then on.
Doctor: stale-padding, at AscendCudaGraphMixin_fill_buffers_cudagraph (padded rows keep the last step's
kv_start_indices, so a live request's cached K/V depends on what the padded rows hold).
Fix (upstream): ``fill_buffers`` first resets whole buffers (``kv_start_indices.fill_(-1)``,
``block_offsets.zero_()``, ``kv_seqlens.fill_(0)``, ``x_active_mask.fill_(0)``, ``position_ids.zero_()``, the
padding tail of ``input_ids`` ``random_(0, vocab_size)``), ``make_buffers`` uses ``torch.zeros`` for
``input_ids``/``position_ids``, and the graph gets the whole per-bucket buffers instead of ``[:new_batch_size]``.
Modelled: one attention layer (K/V depend on token and position only), one head, a LIFO block free list with
block 0 never handed out; eager prefill; teacher-forced decode tokens; the padding tail of ``input_ids`` is
drawn from a seeded CPU generator (not ``random_``); ``x_active_mask``/MoE, ``q_seqlens``/``q_start_loc`` and
the ``graph.update(actual_seq_lengths_kv)`` host path are left out (``kv_seqlens`` is a device buffer here).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/DeepLink-org/dlinfer/pull/306"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "AscendCudaGraphMixin_fill_buffers_cudagraph"
SYMPTOM = "padded ACL-graph rows rewrite a finished request's slot, corrupting the new request that reuses it"

VOCAB, DIM, BLOCK_SIZE, NUM_GPU_BLOCKS, NUM_BLOCKS_PER_SEQ = 32, 8, 4, 16, 3
MAX_CTX = BLOCK_SIZE * NUM_BLOCKS_PER_SEQ
PROMPTS = {"A": 5, "B": 3, "C": 6, "D": 2}
# decode steps (who decodes); "finish" frees blocks, "prefill" admits a new request (eager, as in lmdeploy)
SCRIPT = (("decode", "ABCD"), ("decode", "ABCD"), ("finish", "CD"), ("prefill", {"E": 4}),
          ("decode", "ABE"), ("decode", "ABE"))


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def get_ascend_compatible_size(n: int) -> int:
    return next_power_of_2(n) if n <= 16 else (n + 15) & ~0xF


class AttnMetadata:
    def __init__(self, block_offsets, kv_seqlens, kv_start_indices):
        self.block_offsets, self.kv_seqlens, self.kv_start_indices = block_offsets, kv_seqlens, kv_start_indices


class CudaGraphMeta:
    def __init__(self, max_batchs, max_tokens, num_blocks, device, vocab_size):
        self.max_batchs, self.max_tokens, self.num_blocks = max_batchs, max_tokens, num_blocks
        self.device, self.vocab_size = device, vocab_size
        self.input_buffers: dict = {}
        self.output_buffers: dict = {}


def fill_kv_cache(key, value, key_cache, value_cache, kv_indices):
    """``atb._npu_reshape_and_cache``: row i goes to slot ``kv_indices[i]``; a negative slot is skipped."""
    skip = kv_indices < 0
    slot = kv_indices.long().clamp(min=0)                 # block 0 is never handed out: skipped rows rewrite it as is
    key_cache[slot] = torch.where(skip[:, None], key_cache[slot], key)
    value_cache[slot] = torch.where(skip[:, None], value_cache[slot], value)


def paged_decode_attention(query, key_cache, value_cache, block_table, kv_seq_len):
    ctx = torch.arange(MAX_CTX, device=query.device)
    slots = block_table.long()[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE      # [rows, MAX_CTX]
    scores = (key_cache[slots] @ query[:, :, None]).squeeze(-1) / DIM ** 0.5
    scores = scores.masked_fill(ctx[None, :] >= kv_seq_len.long()[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * value_cache[slots]).sum(1)


class Model:
    """Embedding + position, one paged-attention layer (K/V written for every row first), output projection."""

    def __init__(self, device):
        gen = generator(306)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_CTX, DIM, gen=gen, device=device)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=sc) for sc in (0.3, 0.3, 1, 1))

    def kv(self, input_ids, position_ids):
        h = self.emb[input_ids.long()] + self.pos[position_ids.long().clamp(0, MAX_CTX - 1)]
        return h, h @ self.wk, h @ self.wv

    def __call__(self, input_ids, position_ids, past_key_values, attn_metadata):
        h, k, v = self.kv(input_ids[0], position_ids[0])
        key_cache, value_cache = past_key_values
        fill_kv_cache(k, v, key_cache, value_cache, attn_metadata.kv_start_indices)
        attn = paged_decode_attention(h @ self.wq, key_cache, value_cache, attn_metadata.block_offsets,
                                      attn_metadata.kv_seqlens)
        return h + attn @ self.wo


def AscendCudaGraphMixin_make_buffers_cudagraph(graph_meta: CudaGraphMeta, variant):  # noqa: N802
    mb, mt, dev = graph_meta.max_batchs, graph_meta.max_tokens, graph_meta.device
    alloc = torch.empty if variant == "bug" else torch.zeros
    return {"input_ids": alloc((1, mt), dtype=torch.int32, device=dev),
            "position_ids": alloc((1, mt), dtype=torch.int32, device=dev),
            "block_offsets": torch.zeros((mb, graph_meta.num_blocks), dtype=torch.int32, device=dev),
            "kv_seqlens": torch.ones(mb, dtype=torch.int32, device=dev),
            "kv_start_indices": -torch.ones(mb, dtype=torch.int32, device=dev)}


def AscendCudaGraphMixin_fill_buffers_cudagraph(graph_meta: CudaGraphMeta, input_ids, position_ids,  # noqa: N802
                                                past_key_values, attn_metadata: AttnMetadata, variant, pad_gen):
    buf = graph_meta.input_buffers
    batch_size, num_blocks = attn_metadata.block_offsets.size()
    num_tokens = input_ids.size(-1)
    if variant == "fix":
        max_num_tokens = buf["input_ids"].size(-1)
        if num_tokens < max_num_tokens:                       # random_(0, vocab_size) on the padding tail
            pad = torch.randint(0, graph_meta.vocab_size, (1, max_num_tokens - num_tokens), generator=pad_gen)
            buf["input_ids"][:, num_tokens:max_num_tokens] = pad.to(buf["input_ids"].device, torch.int32)
        buf["position_ids"].zero_()
        buf["block_offsets"].zero_()
        buf["kv_seqlens"].fill_(0)
        buf["kv_start_indices"].fill_(-1)
    buf["input_ids"][:, :num_tokens] = input_ids
    buf["position_ids"][:, :num_tokens] = position_ids
    buf["block_offsets"][:batch_size, :num_blocks] = attn_metadata.block_offsets
    buf["kv_seqlens"][:batch_size] = attn_metadata.kv_seqlens
    buf["kv_start_indices"][:batch_size] = attn_metadata.kv_start_indices
    new_batch_size = min(get_ascend_compatible_size(batch_size), graph_meta.max_batchs)
    meta = AttnMetadata(buf["block_offsets"][:new_batch_size], buf["kv_seqlens"][:new_batch_size],
                        buf["kv_start_indices"][:new_batch_size])
    return dict(input_ids=buf["input_ids"][:, :new_batch_size], position_ids=buf["position_ids"][:, :new_batch_size],
                past_key_values=past_key_values, attn_metadata=meta)


class AscendSingleGraphRunner:
    def __init__(self, model, max_batches, num_blocks, device, variant, pad_gen):
        self.model, self.variant, self.pad_gen = model, variant, pad_gen
        self.meta = CudaGraphMeta(max_batches, max_batches, num_blocks, device, VOCAB)
        self._graph = None

    def capture(self, **kwargs):
        self.meta.input_buffers = AscendCudaGraphMixin_make_buffers_cudagraph(self.meta, self.variant)
        padded = AscendCudaGraphMixin_fill_buffers_cudagraph(self.meta, **kwargs, variant=self.variant,
                                                             pad_gen=self.pad_gen)
        self._graph, self.meta.output_buffers["hidden"] = capture(
            lambda: self.model(**padded), device=self.meta.device, name=f"decode bucket {self.meta.max_batchs}",
            owner="AscendSingleGraphRunner", static=self.meta.input_buffers,
            state={"key_cache": kwargs["past_key_values"][0], "value_cache": kwargs["past_key_values"][1]})

    def forward(self, **kwargs):
        AscendCudaGraphMixin_fill_buffers_cudagraph(self.meta, **kwargs, variant=self.variant, pad_gen=self.pad_gen)
        buf, bs, size = self.meta.input_buffers, kwargs["input_ids"].size(-1), self.meta.max_batchs
        stale = {} if self.variant == "fix" else {k: buf[k] for k in ("block_offsets", "kv_seqlens", "kv_start_indices")}
        cols = {} if self.variant == "fix" else {k: (buf[k], bs) for k in ("input_ids", "position_ids")}
        out = replay(self._graph, self.meta.output_buffers["hidden"], real=bs, size=size, padded=stale,
                     padded_columns=cols)
        return out[:bs].clone()


class AscendGraphRunner:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self._runner_map: dict = {}
        self.pad_gen = generator(3060)

    def __call__(self, **kwargs):
        key = get_ascend_compatible_size(kwargs["input_ids"].numel())       # (new_num_tokens, is_decoding)
        if key not in self._runner_map:
            runner = AscendSingleGraphRunner(self.model, key, NUM_BLOCKS_PER_SEQ, self.device, self.variant,
                                             self.pad_gen)
            runner.capture(**kwargs)
            self._runner_map[key] = runner
        return self._runner_map[key].forward(**kwargs)


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    gen = generator(3061)
    prompt_tokens = {s: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for s, n in {**PROMPTS, "E": 4}.items()}
    decode_tokens = torch.randint(0, VOCAB, (len(SCRIPT), 8), generator=gen)

    def serve(graphed: bool):
        key_cache = torch.zeros(NUM_GPU_BLOCKS * BLOCK_SIZE, DIM, device=device)
        value_cache = torch.zeros_like(key_cache)
        free = list(range(NUM_GPU_BLOCKS - 1, 0, -1))        # LIFO free list; block 0 is never handed out
        seqs: dict[str, list] = {}                           # name -> [length, blocks]
        runner = AscendGraphRunner(model, device, variant) if graphed else None
        outs = []

        def prefill(name, toks):
            seqs[name] = [0, []]
            for t in toks:
                decode_slot(name)
                _, k, v = model.kv(torch.tensor([t], device=device), torch.tensor([seqs[name][0] - 1], device=device))
                slot = slot_of(name, seqs[name][0] - 1)
                key_cache[slot], value_cache[slot] = k[0], v[0]

        def decode_slot(name):                               # grow by one token, allocating a block if needed
            length, blocks = seqs[name]
            if length % BLOCK_SIZE == 0:
                blocks.append(free.pop())
            seqs[name][0] = length + 1

        def slot_of(name, pos):
            return seqs[name][1][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

        for name, n in PROMPTS.items():
            prefill(name, prompt_tokens[name])
        for step, (op, arg) in enumerate(SCRIPT):
            if op == "finish":
                for name in arg:
                    free.extend(seqs.pop(name)[1])
                continue
            if op == "prefill":
                for name, n in arg.items():
                    prefill(name, prompt_tokens[name])
                continue
            for name in arg:
                decode_slot(name)
            i32 = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device)          # noqa: E731
            pos = [seqs[s][0] - 1 for s in arg]
            meta = AttnMetadata(i32([seqs[s][1] + [0] * (NUM_BLOCKS_PER_SEQ - len(seqs[s][1])) for s in arg]),
                                i32([seqs[s][0] for s in arg]), i32([slot_of(s, p) for s, p in zip(arg, pos)]))
            kwargs = dict(input_ids=i32([decode_tokens[step, :len(arg)].tolist()]), position_ids=i32([pos]),
                          past_key_values=(key_cache, value_cache), attn_metadata=meta)
            outs.append(runner(**kwargs) if graphed else model(**kwargs))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
