"""The target-verify decode graph's static block-id buffer has one spare column: a stream near its end needs sp_steps.

Upstream: https://github.com/alibaba/rtp-llm/commit/9942194b93c6187c5d82ae93a24d781b609a582e ("feat: support
qwen3 next mtp cudagraph & fix hybrid cache bugs", a direct commit on main, March 2026). Diff read for
``rtp_llm/cpp/devices/cuda_impl/CudaGraphRunner.{cc,h}`` and ``CudaGraphUtils.h``, plus ``copySmallerIntoLarger``
and ``prepareInputs`` at the parent; ``PyWrappedModel.h`` and ``MtpExecutor.cc`` were not read. Only part (a)
of the commit is modelled (the block-id buffer width), not the ``canRun`` target-verify flag (b).
Symptom: not stated (a feature commit that "fixes" along the way). From the code: an MTP target-verify batch
whose block table is wider than the captured buffer makes ``prepareInputs`` throw "Target tensor dimension 1
(...) is smaller than source tensor dimension 1 (...). This violates the function's guarantee." instead of
replaying the graph.
Mechanism: ``CudaGraphRunner::initCaptureAttentionInputs`` allocates the capture-time
``kv_cache_block_id_device`` as ``[max_bs_, ceil(max_seq_len_ / seq_size_per_block_) + 1]``. The graph for
the target model's verify step (``num_tokens_per_bs_ = sp_steps_ + 1`` tokens per request) is replayed on
batches whose block table (``NormalBatchStreamProcessor``: ``max_blocks_num = stream_groups.curBlocksNum()``)
holds the blocks of each stream's sequence *and* of its ``sp_steps_ + 1`` verify tokens. Before each replay
``prepareInputs`` zero-fills the static table and calls ``copySmallerIntoLarger(batch table, static table)``,
which throws when the source has more columns: a stream whose sequence is near ``max_seq_len_`` needs up to
``sp_steps_`` more blocks than ``ceil(max_seq_len_ / seq_size_per_block_)``, one spare column is not enough.
(Assumed from the diff, not read: the stream's cache resource holds the verify tokens' blocks when the batch is
built; here the widest table is that of a stream at ``max_seq_len_ - 1`` tokens verifying ``sp_steps_ + 1``.)
Doctor: undersized-buffer, at ``copySmallerIntoLarger`` (the batch's block table does not fit the static
``kv_cache_block_id_device`` sized at capture).
Fix (upstream): ``max_blocks = ceil(max_seq_len_ / seq_size_per_block_) + sp_steps_`` (``sp_steps_`` comes from
the graph params), so the static block table has a column for every block a verify step can touch.
(Eager: the same model and cache, each step run with its own block table; prefills always run eagerly.)
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/9942194b93c6187c5d82ae93a24d781b609a582e"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "copySmallerIntoLarger"
SYMPTOM = "an MTP target-verify batch near max_seq_len cannot be copied into the graph's block-id buffer (throws)"

VOCAB, DIM = 16, 4
MAX_SEQ_LEN, SEQ_SIZE_PER_BLOCK, SP_STEPS = 8, 2, 3
NUM_TOKENS_PER_BS = SP_STEPS + 1            # target verify: the last accepted token plus the draft tokens
MAX_BS = 2
NUM_BLOCKS = 16                              # block 0 is the null block


class Model:
    def __init__(self, device):
        gen = generator(9942194)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)


def forward(model, kv_cache, input_ids, prefix_lengths, kv_cache_block_id_device, num_tokens_per_bs):
    """Each request's ``num_tokens_per_bs`` tokens sit at ``prefix + t``: write their keys through the block
    table, then attend causally over the request's cached keys (values = keys)."""
    B = SEQ_SIZE_PER_BLOCK
    t = torch.arange(num_tokens_per_bs, device=input_ids.device)
    positions = (prefix_lengths[:, None] + t[None, :]).reshape(-1)
    table = kv_cache_block_id_device.repeat_interleave(num_tokens_per_bs, 0)         # [tokens, cols]
    h = model.emb[input_ids]
    slots = table.gather(1, (positions // B)[:, None]).squeeze(1) * B + positions % B
    kv_cache[slots] = h @ model.wk
    ctx = torch.arange(table.shape[1] * B, device=input_ids.device)
    keys = kv_cache[table[:, ctx // B] * B + ctx % B]                                   # [tokens, ctx, DIM]
    scores = (keys @ (h @ model.wq)[:, :, None]).squeeze(-1)
    scores = scores.masked_fill(ctx[None, :] > positions[:, None], -1e9)
    return (torch.softmax(scores, -1)[:, :, None] * keys).sum(1) @ model.wo


class CudaGraphRunner:
    """The target model's decode-graph runner in target-verify mode (``num_tokens_per_bs_ > 1``)."""

    def __init__(self, model, kv_cache, device, variant):
        self.model, self.kv_cache, self.device, self.variant = model, kv_cache, device, variant
        self.max_bs_, self.num_tokens_per_bs_ = MAX_BS, NUM_TOKENS_PER_BS
        self.max_seq_len_, self.seq_size_per_block_, self.sp_steps_ = MAX_SEQ_LEN, SEQ_SIZE_PER_BLOCK, SP_STEPS
        self.initCaptureAttentionInputs()
        self.graph, self.out = capture(
            lambda: forward(model, kv_cache, self.input_ids, self.prefix_lengths,
                            self.kv_cache_block_id_device, self.num_tokens_per_bs_),
            device=device, owner="CudaGraphRunner (target-verify decode graph)",
            static={"input_ids": self.input_ids, "prefix_lengths": self.prefix_lengths,
                    "kv_cache_block_id_device": self.kv_cache_block_id_device},
            state={"kv_cache": kv_cache})

    def initCaptureAttentionInputs(self):
        i32 = dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(self.max_bs_ * self.num_tokens_per_bs_, **i32)
        self.prefix_lengths = torch.zeros(self.max_bs_, **i32)
        blocks = (self.max_seq_len_ + self.seq_size_per_block_ - 1) // self.seq_size_per_block_
        if self.variant == "bug":
            max_blocks = blocks + 1
        else:
            max_blocks = blocks + self.sp_steps_
        # kv_cache_block_id_device [batch_size, block_num]
        self.kv_cache_block_id_device = torch.zeros(self.max_bs_, max_blocks, **i32)

    @staticmethod
    def copySmallerIntoLarger(source_tensor, target_tensor):
        for i in range(source_tensor.dim()):
            if source_tensor.size(i) > target_tensor.size(i):
                raise RuntimeError(
                    f"Error: Target tensor dimension {i} ({target_tensor.size(i)}) is smaller than source tensor "
                    f"dimension {i} ({source_tensor.size(i)}). This violates the function's guarantee.")
        target_slice = target_tensor
        for i in range(source_tensor.dim()):
            target_slice = target_slice.narrow(i, 0, source_tensor.size(i))
        target_slice.copy_(source_tensor)

    def prepareInputs(self, input_ids, prefix_lengths, block_ids):
        # clear kv_cache_block_id_device, otherwise it will cause the cache block pollution
        self.kv_cache_block_id_device.fill_(0)
        self.prefix_lengths.copy_(prefix_lengths)
        self.input_ids.copy_(input_ids)
        self.copySmallerIntoLarger(block_ids, self.kv_cache_block_id_device)

    def forward(self, input_ids, prefix_lengths, block_ids):
        self.prepareInputs(input_ids, prefix_lengths, block_ids)
        return replay(self.graph, self.out).clone()


def block_table(streams, device):
    """``NormalBatchStreamProcessor``: one row per stream, ``curBlocksNum()`` columns (the widest stream)."""
    width = max(len(b) for b in streams)
    return torch.tensor([b + [0] * (width - len(b)) for b in streams], dtype=torch.long, device=device)


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731

    def serve(graphed: bool):
        kv_cache = torch.zeros(NUM_BLOCKS * SEQ_SIZE_PER_BLOCK, DIM, device=device)
        runner = CudaGraphRunner(model, kv_cache, device, variant) if graphed else None
        outs = []
        # Prefill (always eager): A has a 3-token prompt, B a 5-token prompt.
        A, B = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]              # blocks held, incl. the verify tokens' blocks
        outs.append(forward(model, kv_cache, t([3, 1, 4]), t([0]), block_table([A[:2]], device), 3).clone())
        outs.append(forward(model, kv_cache, t([1, 5, 9, 2, 6]), t([0]), block_table([B[:3]], device), 5).clone())

        def verify(ids, prefixes, streams):
            ids, prefixes, table = t(ids), t(prefixes), block_table(streams, device)
            if runner is None:
                return forward(model, kv_cache, ids, prefixes, table, NUM_TOKENS_PER_BS).clone()
            return runner.forward(ids, prefixes, table)

        # Verify step 1: A at 3 tokens (+4 -> 7 tokens, 4 blocks), B at 5 (+4 -> 9 tokens, 5 blocks).
        outs.append(verify([5, 3, 5, 8, 9, 7, 9, 3], [3, 5], [A, B[:5]]))
        # Verify step 2: one draft token accepted each; B at 7 tokens, max_seq_len - 1 (+4 -> 11 tokens, 6 blocks).
        outs.append(verify([2, 3, 8, 4, 6, 2, 6, 4], [4, 7], [A[:4], B]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
