"""LMDeploy on Cambricon MLU (dlinfer camb backend): the decode graph bakes the capture batch's host-side ``max_kv_seq_len`` into the paged-attention kernel, so every replay attends to at most that many cached tokens.

Upstream: https://github.com/DeepLink-org/dlinfer/pull/298 ("[fix]fix camb run qwen vl", DeepLink-org/dlinfer, merged
as commit df4b56c, 2026-02-04). Read: the squashed commit with its full diff (mirrored repository):
``dlinfer/framework/lmdeploy_ext/cudagraph/camb_cudagraph.py`` -- in ``CambCudaGraphMixin_fill_buffers_cudagraph`` the
fix adds ``attn_metadata.max_kv_seq_len = -1`` and ``attn_metadata.max_q_seq_len = -1`` with the comment "max_kv_seq_len
is Python int, which gets fixed during graph capture. According to torch_mlu_ops API: 'If max_contxt_len <= 0,
indicating an uncertain maximum value of context_lens.' So we set it to -1, and let the kernel compute max from
kv_seqlens tensor internally"; the same commit also resizes ``kv_start_indices`` to the batch, computes the padded size
from the batch size instead of the token count, and refreshes ``block_offsets``/``kv_start_indices`` in
``CambCudaGraphMixin_update_context_cudagraph``. Also read (pre-fix): the whole of ``camb_cudagraph.py``,
``dlinfer/vendor/camb/camb_ops.py::paged_decode_attention`` (passes ``max_kv_seq_len`` as ``max_contxt_len`` to
``tmo.single_query_cached_kv_attn``), and on the LMDeploy side (2026-02 snapshot) ``CambOpsBackend.update_step_context``
(``max_kv_seq_len = torch.max(kv_seqlens).cpu().item()``, decode ``kv_start_indices`` from the last block),
``DlinferAttentionImpl.forward`` / ``paged_attention_fwd`` (forward ``attn_metadata.max_kv_seq_len`` to the kernel),
``CUDASingleGraphRunner.capture/forward``, ``CUDAGraphRunner.__call__`` / ``get_graph_key`` (lazy capture per padded
batch size, a shared graph pool) and ``BaseModelAgent.warmup`` / ``make_dummy_inputs`` (decode graphs for every capture
size are captured at startup on dummy inputs with ``history_lengths=0``, ``seq_length=1``, dummy block 0). Reconstructed:
what the MLU kernel does with a ``max_contxt_len`` smaller than a row's ``context_len`` (modelled as a bound on the
context positions it reads); the other hunks of the commit are not switched by the variant (the pre-fix padded size
``next_power_of_2(num_tokens)`` is kept: in a decode batch the token count equals the batch size, so they change nothing
in this workload).
Symptom: LMDeploy PyTorch engine on Cambricon MLU with graph mode: decoding produces wrong tokens (the PR was titled
after Qwen-VL, which failed to run correctly); ``--eager-mode`` gives the right answer.
Mechanism: ``CambOpsBackend.update_step_context`` computes ``max_kv_seq_len`` on the host (``.cpu().item()``) and stores
it in the attention metadata as a Python int. ``CambCudaGraphMixin_fill_buffers_cudagraph`` repoints the metadata's
tensors at the graph's input buffers but leaves that int as it is, so the captured ``paged_decode_attention`` launch
takes the capture batch's value as ``max_contxt_len``: with the startup warmup that is 1 (dummy decode inputs). Replays
refresh ``kv_seqlens`` in the buffer, but the kernel argument stays 1, so each request attends only to its first
cached token. Eager steps recompute the maximum every step.
Doctor: host-work-frozen, at CambCudaGraphMixin_fill_buffers_cudagraph. A Python scalar computed on the host for the
capture batch (the batch's maximum KV length) becomes an argument of a captured kernel; replays repeat only the kernel,
so the value stays at its capture-time 1 while the host computes a new maximum every step.
Fix (upstream): set ``attn_metadata.max_kv_seq_len = -1`` (and ``max_q_seq_len = -1``) in the graph path, so the kernel
derives the maximum from the ``kv_seqlens`` tensor it reads at every replay.
Modelled: dlinfer's ``CambCudaGraphMixin_make_buffers_cudagraph`` / ``_fill_buffers_cudagraph`` /
``_update_context_cudagraph`` patched onto ``CudaGraphMixin`` as upstream does, ``paged_decode_attention`` and
``fill_kv_cache`` (stand-ins for the torch_mlu_ops kernels, camb KV layout ``[num_blocks, heads, block_size,
head_dim]``), LMDeploy's ``CambOpsBackend.update_step_context`` (decode and prefill slots), ``DlinferAttentionMetadata``,
``CUDASingleGraphRunner`` (make buffers, fill, warm up once, capture into the shared pool; replay), ``CUDAGraphRunner``
(graph key = capture size >= batch, eager when not decoding or in eager mode) and ``BaseModelAgent.warmup`` on
``make_dummy_inputs``. The model is a stand-in: embedding plus position table, one attention layer, an lm head (hidden
8, 2 heads of 4, vocab 16, float64); block size 4, 16 blocks (block 0 is the dummy block), capture sizes [1, 2, 4].
Workload: startup warmup captures the decode graphs for 4, 2 and 1 on dummy inputs. Requests A (5 prompt tokens) and B
(7) are prefilled eagerly and decode 3 greedy steps as a batch of 2; then C (3) and D (6) are prefilled and all four
decode 3 steps as a batch of 4 (no padding: every batch hits a captured size). The decode logits of every step are
compared. In the bug every replay attends to one cached token only: the logits differ by 17.8 at the first decode
step (greedy tokens diverge at once) and by up to 29.7 over the run. The fix equals eager.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/DeepLink-org/dlinfer/pull/298"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "CambCudaGraphMixin_fill_buffers_cudagraph"
SYMPTOM = ("LMDeploy graph mode on Cambricon MLU decodes wrong tokens: the captured paged decode attention keeps the "
           "capture batch's host-side max_kv_seq_len (1 at the startup warmup) as max_contxt_len, so replays attend "
           "to one cached token per request; eager mode is correct")

HIDDEN, VOCAB = 8, 16
NUM_HEADS, HEAD_DIM = 2, 4
BLOCK_SIZE, NUM_GPU_BLOCKS = 4, 16
MAX_POS = NUM_GPU_BLOCKS * BLOCK_SIZE
DUMMY_BLOCK_ID = 0
MAX_BATCHES = 4

_variant = "bug"


# --- dlinfer/vendor/camb/camb_ops.py (stand-ins for the torch_mlu_ops kernels) ---------------------------------------

def fill_kv_cache(key, value, key_cache, value_cache, kv_start_indices):
    """Write one K/V row per slot; camb caches are ``[num_blocks, heads, block_size, head_dim]``."""
    slots = kv_start_indices.to(torch.int64)
    blk, off = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    key_cache[blk, :, off] = key
    value_cache[blk, :, off] = value
    return key_cache, value_cache


def paged_decode_attention(query, key_cache, value_cache, block_table, block_size, kv_seq_len, max_kv_seq_len,
                           num_q_heads, num_kv_heads, softmax_scale, attn_output):
    """``tmo.single_query_cached_kv_attn(..., max_contxt_len=max_kv_seq_len, ...)``: with a positive
    ``max_contxt_len`` the kernel works on at most that many context positions per row; ``<= 0`` means the maximum
    is unknown and it follows ``context_lens`` alone."""
    num_cols = block_table.shape[1] * block_size
    pos = torch.arange(num_cols, device=query.device)
    blk = block_table.to(torch.int64)[:, pos // block_size]                # [B, P]
    keys = key_cache[blk, :, pos % block_size]                              # [B, P, H, D]
    vals = value_cache[blk, :, pos % block_size]
    context = kv_seq_len.to(torch.int64)
    if max_kv_seq_len > 0:
        context = context.clamp(max=max_kv_seq_len)
    scores = torch.einsum("bhd,bphd->bhp", query, keys) * softmax_scale
    visible = (pos.unsqueeze(0) < context.unsqueeze(1)).unsqueeze(1)       # [B, 1, P]
    scores = scores.masked_fill(~visible, float("-inf"))
    attn_output.copy_(torch.einsum("bhp,bphd->bhd", torch.softmax(scores, -1), vals))
    return attn_output


# --- lmdeploy/pytorch/backends/dlinfer -------------------------------------------------------------------------------

@dataclass
class DlinferAttentionMetadata:
    is_decoding: bool
    block_offsets: torch.Tensor
    q_start_loc: torch.Tensor = None
    q_seqlens: torch.Tensor = None
    kv_seqlens: torch.Tensor = None
    kv_start_indices: torch.Tensor = None
    block_size: int = BLOCK_SIZE
    max_q_seq_len: int = 1
    max_kv_seq_len: int = 1


@dataclass
class StepContext:
    is_decoding: bool
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    q_start_loc: torch.Tensor
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    block_offsets: torch.Tensor
    kv_caches: list
    attn_metadata: DlinferAttentionMetadata = None
    kv_start_indices: torch.Tensor = None


class CambOpsBackend:
    total_slots = None

    @classmethod
    def update_step_context(cls, step_context):
        """Update step context (host side, before every forward)."""
        block_num, _, block_size, _ = step_context.kv_caches[0][0].shape
        if cls.total_slots is None or cls.total_slots.device != step_context.block_offsets.device:
            cls.total_slots = torch.arange(block_num * block_size, dtype=torch.int32,
                                           device=step_context.block_offsets.device).view(block_num, block_size)
        q_start_loc = step_context.q_start_loc
        q_seqlens = step_context.q_seqlens
        kv_seqlens = step_context.kv_seqlens.to(torch.int32)
        block_offsets = step_context.block_offsets.to(torch.int32)
        max_q_seq_len = torch.max(q_seqlens).cpu().item()
        max_kv_seq_len = torch.max(kv_seqlens).cpu().item()
        cu_seqlens = torch.cat((q_start_loc, q_seqlens.sum().unsqueeze(0))).int()
        if not step_context.is_decoding:
            kv_start_indices = []
            for i, (q_len, kv_len) in enumerate(zip(q_seqlens.tolist(), kv_seqlens.tolist())):
                slot_tables = cls.total_slots[block_offsets[i].long()].view(-1)
                kv_start_indices.append(slot_tables[kv_len - q_len:kv_len])
            kv_start_indices = torch.cat(kv_start_indices)
        else:
            idx = (step_context.kv_seqlens - 1) % block_size
            blk = (step_context.kv_seqlens - 1) // block_size
            last_block = block_offsets.long().gather(1, blk.view(-1, 1)).view(-1)
            kv_start_indices = (last_block * block_size + idx).to(torch.int32)
        step_context.attn_metadata = DlinferAttentionMetadata(
            step_context.is_decoding, block_offsets, q_start_loc=cu_seqlens, q_seqlens=q_seqlens,
            kv_seqlens=kv_seqlens, kv_start_indices=kv_start_indices, block_size=block_size,
            max_q_seq_len=max_q_seq_len, max_kv_seq_len=max_kv_seq_len)
        return step_context


# --- lmdeploy/pytorch/models/utils/cudagraph.py + dlinfer camb_cudagraph.py -----------------------------------------

@dataclass
class CudaGraphMeta:
    max_batchs: int
    max_tokens: int
    num_blocks: int
    is_decoding: bool
    device: torch.device
    input_buffers: dict = field(default_factory=dict)
    output_buffers: dict = field(default_factory=dict)


def next_power_of_2(n: int):
    """Return the smallest power of 2 greater than or equal to n."""
    return 1 << (n - 1).bit_length()


class CudaGraphMixin:
    def make_output_buffers(self, output):
        return dict(logits=output)

    def get_outputs_cudagraph(self, output_buffers, input_ids, **kwargs):
        num_tokens = input_ids.size(-1)
        return output_buffers["logits"][:num_tokens]


def CambCudaGraphMixin_make_buffers_cudagraph(self, graph_meta: CudaGraphMeta, *args, **kwargs):
    """make cudagraph buffers from forward inputs."""
    max_batches, max_tokens = graph_meta.max_batchs, graph_meta.max_tokens
    num_blocks, device = graph_meta.num_blocks, graph_meta.device
    input_buffers = dict()
    input_buffers["input_ids"] = torch.zeros(1, max_tokens, dtype=torch.int32, device=device)
    input_buffers["position_ids"] = torch.ones((1, max_tokens), dtype=torch.int32, device=device)
    input_buffers["block_offsets"] = torch.zeros((max_batches, num_blocks), dtype=torch.int32, device=device)
    # in attn_metadata, we mock q_start_loc as cu_seqlens so need to add 1
    input_buffers["q_start_loc"] = torch.arange(max_batches + 1, dtype=torch.int32, device=device)
    input_buffers["q_seqlens"] = torch.ones(max_batches, dtype=torch.int32, device=device)
    input_buffers["kv_seqlens"] = torch.ones(max_batches, dtype=torch.int32, device=device)
    # critical to set negative for kv_start_indices
    input_buffers["kv_start_indices"] = -torch.ones(max_batches, dtype=torch.int32, device=device)
    return input_buffers


def CambCudaGraphMixin_fill_buffers_cudagraph(self, graph_meta: CudaGraphMeta, input_ids, position_ids,
                                               past_key_values, attn_metadata, **kwargs):
    """fill cudagraph buffers from forward inputs."""
    input_buffers = graph_meta.input_buffers
    batch_size, num_blocks = attn_metadata.block_offsets.size()
    num_tokens = input_ids.size(-1)
    input_buffers["input_ids"][:, :num_tokens] = input_ids
    input_buffers["position_ids"][:, :num_tokens] = position_ids
    input_buffers["block_offsets"][:batch_size, :num_blocks] = attn_metadata.block_offsets
    input_buffers["q_seqlens"][:batch_size] = attn_metadata.q_seqlens
    input_buffers["kv_seqlens"][:batch_size] = attn_metadata.kv_seqlens
    input_buffers["q_start_loc"][:batch_size + 1] = attn_metadata.q_start_loc
    input_buffers["kv_start_indices"][:batch_size] = attn_metadata.kv_start_indices

    # below only used for capture graph
    new_batch_size = next_power_of_2(num_tokens)
    attn_metadata.block_offsets = input_buffers["block_offsets"][:new_batch_size]
    attn_metadata.q_start_loc = input_buffers["q_start_loc"][:new_batch_size + 1]
    attn_metadata.q_seqlens = input_buffers["q_seqlens"][:new_batch_size]
    attn_metadata.kv_seqlens = input_buffers["kv_seqlens"][:new_batch_size]
    attn_metadata.kv_start_indices = input_buffers["kv_start_indices"][:new_batch_size]
    if _variant == "fix":
        # max_kv_seq_len is a Python int, fixed at capture: let the kernel take the max of kv_seqlens itself
        attn_metadata.max_kv_seq_len = -1
        attn_metadata.max_q_seq_len = -1
    new_inputs = dict(past_key_values=past_key_values, attn_metadata=attn_metadata)
    new_inputs["input_ids"] = input_buffers["input_ids"][:, :new_batch_size]
    new_inputs["position_ids"] = input_buffers["position_ids"][:, :new_batch_size]
    return new_inputs


def CambCudaGraphMixin_update_context_cudagraph(self, graph_meta, context):
    """update step context with input buffers."""
    input_buffers = graph_meta.input_buffers
    context.block_offsets = input_buffers["block_offsets"]
    context.q_seqlens = input_buffers["q_seqlens"]
    context.kv_seqlens = input_buffers["kv_seqlens"]
    context.q_start_loc = input_buffers["q_start_loc"]
    context.kv_start_indices = input_buffers["kv_start_indices"]


CudaGraphMixin.make_buffers_cudagraph = CambCudaGraphMixin_make_buffers_cudagraph
CudaGraphMixin.fill_buffers_cudagraph = CambCudaGraphMixin_fill_buffers_cudagraph
CudaGraphMixin.update_context_cudagraph = CambCudaGraphMixin_update_context_cudagraph


# --- the model (stand-in) --------------------------------------------------------------------------------------------

class TinyCambModel(CudaGraphMixin):
    """Embedding + position table, one attention layer over the paged camb KV cache, lm head."""

    def __init__(self, device):
        gen = generator(298)
        r = lambda *s, scale=0.6: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed, self.pos_embed = r(VOCAB, HIDDEN, scale=1.0), r(MAX_POS, HIDDEN, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.9)
        shape = (NUM_GPU_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_DIM)
        self.kv_caches = [(torch.zeros(shape, dtype=torch.float64, device=device),
                           torch.zeros(shape, dtype=torch.float64, device=device))]
        self.scale = HEAD_DIM ** -0.5

    def __call__(self, input_ids, position_ids, past_key_values, attn_metadata, **kwargs):
        return self.forward(input_ids, position_ids, past_key_values, attn_metadata)

    def forward(self, input_ids, position_ids, past_key_values, attn_metadata):
        x = self.embed[input_ids[0].long()] + self.pos_embed[position_ids[0].long()]     # [T, H]
        q = (x @ self.wq).view(-1, NUM_HEADS, HEAD_DIM)
        k = (x @ self.wk).view(-1, NUM_HEADS, HEAD_DIM)
        v = (x @ self.wv).view(-1, NUM_HEADS, HEAD_DIM)
        key_cache, value_cache = past_key_values[0]
        fill_kv_cache(k, v, key_cache, value_cache, attn_metadata.kv_start_indices)      # DlinferAttentionImpl
        if attn_metadata.is_decoding:
            out = torch.empty_like(q)
            paged_decode_attention(q, key_cache, value_cache, attn_metadata.block_offsets, BLOCK_SIZE,
                                   attn_metadata.kv_seqlens, attn_metadata.max_kv_seq_len, NUM_HEADS, NUM_HEADS,
                                   self.scale, out)
        else:                                                                           # prefill (no cached prefix)
            outs, start = [], 0
            for q_len in attn_metadata.q_seqlens.tolist():
                qs, ks, vs = q[start:start + q_len], k[start:start + q_len], v[start:start + q_len]
                scores = torch.einsum("thd,shd->hts", qs, ks) * self.scale
                causal = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
                outs.append(torch.einsum("hts,shd->thd", torch.softmax(scores, -1), vs))
                start += q_len
            out = torch.cat(outs)
        return (x + out.reshape(-1, HIDDEN) @ self.wo) @ self.lm_head


# --- lmdeploy/pytorch/backends/cuda/graph_runner.py ------------------------------------------------------------------

class CUDASingleGraphRunner:
    def __init__(self, model, max_batches, max_tokens, num_blocks, is_decoding, pool, device):
        self.model = model
        self.meta = CudaGraphMeta(max_batchs=max_batches, max_tokens=max_tokens, num_blocks=num_blocks,
                                  is_decoding=is_decoding, device=device)
        self.pool, self.device = pool, device
        self._graph = None
        self.context = None

    def capture(self, **kwargs):
        self.meta.input_buffers = self.model.make_buffers_cudagraph(self.meta, **kwargs)
        padded_kwargs = self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self.model.update_context_cudagraph(self.meta, self.context)
        bufs = self.meta.input_buffers
        # warm up once, then capture into the shared graph pool
        self._graph, output = capture(lambda: self.model(**padded_kwargs), device=self.device, pool=self.pool,
                                      warmups=1, name=f"decode bs={self.meta.max_batchs}",
                                      owner="CUDASingleGraphRunner", static=bufs,
                                      state={"key_cache": self.model.kv_caches[0][0],
                                             "value_cache": self.model.kv_caches[0][1]})
        self.meta.output_buffers = self.model.make_output_buffers(output)
        return self.model.get_outputs_cudagraph(self.meta.output_buffers, **kwargs)

    def forward(self, **kwargs):
        self.model.fill_buffers_cudagraph(self.meta, **kwargs)
        self.model.update_context_cudagraph(self.meta, self.context)
        logits = replay(self._graph, self.meta.output_buffers["logits"])
        return self.model.get_outputs_cudagraph(dict(logits=logits), **kwargs)


class CUDAGraphRunner:
    def __init__(self, model, device, eager_mode):
        self.model, self.device, self.eager_mode = model, device, eager_mode
        self.graph_pool_handle = None if eager_mode else graph_pool_handle(device)
        self._runner_map = dict()

    def get_capture_batch_sizes(self):
        return [1, 2, 4]

    def get_graph_key(self, attn_metadata, **kwargs):
        batch_size = attn_metadata.q_seqlens.size(0)
        return next(s for s in self.get_capture_batch_sizes() if s >= batch_size), attn_metadata.is_decoding

    def __call__(self, context, **kwargs):
        if self.eager_mode or not kwargs["attn_metadata"].is_decoding:
            return self.model(**kwargs)
        graph_key = self.get_graph_key(**kwargs)
        if graph_key not in self._runner_map:
            runner = CUDASingleGraphRunner(self.model, max_batches=graph_key[0], max_tokens=graph_key[0],
                                           num_blocks=NUM_GPU_BLOCKS, is_decoding=True,
                                           pool=self.graph_pool_handle, device=self.device)
            runner.context = context
            output = runner.capture(**kwargs)
            self._runner_map[graph_key] = runner
            return output
        runner = self._runner_map[graph_key]
        runner.context = context
        return runner.forward(**kwargs)


# --- lmdeploy/pytorch/engine/model_agent (stand-in for the engine loop) ----------------------------------------------

class BaseModelAgent:
    def __init__(self, device, eager_mode):
        self.device = device
        self.model = TinyCambModel(device)
        self.graph_runner = CUDAGraphRunner(self.model, device, eager_mode)
        self.free_blocks = list(range(1, NUM_GPU_BLOCKS))         # block 0: dummy block

    def _forward_impl(self, input_ids, position_ids, q_seqlens, kv_seqlens, block_offsets, is_decoding):
        dev = self.device
        q_seqlens = q_seqlens.to(dev)
        q_start_loc = (q_seqlens.cumsum(0) - q_seqlens).to(torch.int32)
        ctx = StepContext(is_decoding, input_ids.to(dev), position_ids.to(dev), q_start_loc, q_seqlens,
                          kv_seqlens.to(dev), block_offsets.to(dev), self.model.kv_caches)
        ctx = CambOpsBackend.update_step_context(ctx)
        return self.graph_runner(ctx, input_ids=ctx.input_ids, position_ids=ctx.position_ids,
                                 past_key_values=self.model.kv_caches, attn_metadata=ctx.attn_metadata)

    def warmup(self, vocab_gen):
        """Decode graphs for every capture size, on dummy inputs (history 0, one token, dummy block)."""
        for bs in sorted(self.graph_runner.get_capture_batch_sizes(), reverse=True):
            input_ids = torch.randint(0, VOCAB, (1, bs), generator=vocab_gen, dtype=torch.int32)
            self._forward_impl(input_ids, torch.zeros(1, bs, dtype=torch.int32), torch.ones(bs, dtype=torch.int32),
                               torch.ones(bs, dtype=torch.int32),
                               torch.full((bs, 1), DUMMY_BLOCK_ID, dtype=torch.int32), is_decoding=True)

    def prefill(self, seqs):
        ids = torch.tensor([t for s in seqs for t in s["tokens"]], dtype=torch.int32).view(1, -1)
        pos = torch.tensor([p for s in seqs for p in range(len(s["tokens"]))], dtype=torch.int32).view(1, -1)
        lens = torch.tensor([len(s["tokens"]) for s in seqs], dtype=torch.int32)
        logits = self._forward_impl(ids, pos, lens, lens, self._block_table(seqs), is_decoding=False)
        last = (lens.cumsum(0) - 1).to(logits.device)
        return logits[last]

    def decode(self, seqs):
        bs = len(seqs)
        ids = torch.tensor([s["tokens"][-1] for s in seqs], dtype=torch.int32).view(1, bs)
        kv = torch.tensor([len(s["tokens"]) for s in seqs], dtype=torch.int32)
        return self._forward_impl(ids, (kv - 1).view(1, bs), torch.ones(bs, dtype=torch.int32), kv,
                                  self._block_table(seqs), is_decoding=True)

    def _block_table(self, seqs):
        for s in seqs:
            while len(s["blocks"]) * BLOCK_SIZE < len(s["tokens"]):
                s["blocks"].append(self.free_blocks.pop(0))
        width = max(len(s["blocks"]) for s in seqs)
        return torch.tensor([s["blocks"] + [DUMMY_BLOCK_ID] * (width - len(s["blocks"])) for s in seqs],
                            dtype=torch.int32)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 7, 1, 12, 5], "B": [2, 9, 4, 4, 11, 6, 8], "C": [5, 6, 13], "D": [8, 1, 13, 2, 10, 14]}
    decode_steps = 3

    def serve(eager_mode):
        agent = BaseModelAgent(device, eager_mode)
        if not eager_mode:
            agent.warmup(generator(2980))                         # engine startup: capture the decode graphs
        outs, running = [], []
        for names in ("AB", "CD"):
            new = [dict(tokens=list(prompts[n]), blocks=[]) for n in names]
            first = agent.prefill(new).argmax(-1).tolist()
            for s, t in zip(new, first):
                s["tokens"].append(int(t))
            running += new
            for _ in range(decode_steps):
                logits = agent.decode(running)
                outs.append(logits.clone())
                for s, t in zip(running, logits.argmax(-1).tolist()):
                    s["tokens"].append(int(t))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
