"""rtp-llm's spec-decode target (verify) graph held a block table one KV block narrower than a verify step needs.

Upstream: https://github.com/alibaba/rtp-llm/commit/2bfdbc299b0b87cfa99e0e0f50a51151ab0f2161 ("fix: fix target
model spec decode cuda graph", January 2026; a direct commit, no PR).
Symptom: none stated beyond the title (the target-model spec-decode CUDA graph was broken). The harm modelled
is the one the diff implies: a verify step of a request near ``max_seq_len`` needs one KV block more than the
graph's static block table has columns, and ``prepareInputs`` refuses to copy it
(``copySmallerIntoLarger`` throws ``Target tensor dimension 1 ... is smaller than source``).
Mechanism: ``CudaGraphRunner::initCaptureAttentionInputs`` sized the static ``kv_cache_block_id_device`` /
``_host`` buffers ``[max_bs, ceil(max_seq_len / seq_size_per_block)]``. In speculative decoding the target
model scores ``num_tokens_per_bs_`` tokens per request after its prefix (step 2.2.1, which ``canRun`` sends to
the decode graph when ``prefix_lengths[0] > 0`` and every ``input_lengths`` equals ``num_tokens_per_bs_``), so
a request whose prefix is close to ``max_seq_len`` writes its verify tokens past ``max_seq_len`` into one
more block. The batch's ``kv_cache_block_id_device`` is then one column wider than the captured buffer and
``copySmallerIntoLarger`` (called by ``prepareInputs`` before every replay) throws. Eager
(``normalForward``) runs the step with the batch's own table. The dummy capture ``prefix_lengths`` of
``max_seq_len - 1`` likewise described a shorter context than a verify step can reach.
Only the block-table and dummy-prefix hunks are modelled; the commit also computes
``context_total_kv_length`` for the capture inputs (it was left uninitialised) and carries it into the
graph-held ``py_model_inputs_`` (used by the TRT paged-prefill attention of step 2.2.1), which this
model's attention does not use. ``prefix_lengths`` is pinned host memory upstream; here the graph reads a
device copy of it.
Doctor: undersized-buffer, at ``copySmallerIntoLarger`` (a block table that does not fit the static buffer).
Fix (upstream): the static block-table buffers get one more column
(``ceil(max_seq_len / seq_size_per_block) + 1``) and the spec-decode dummy ``prefix_lengths`` becomes
``max_seq_len + num_tokens_per_bs_``, so capture covers the longest verify step.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/2bfdbc299b0b87cfa99e0e0f50a51151ab0f2161"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "copySmallerIntoLarger"
SYMPTOM = "spec-decode verify near max_seq_len: block table does not fit the graph's buffer (throws)"

VOCAB, DIM = 16, 4
MAX_BS, MAX_SEQ_LEN, SEQ_SIZE_PER_BLOCK, NUM_TOKENS_PER_BS = 2, 7, 4, 2
NUM_BLOCKS = 8                                    # block 0 is the null block (zeros pad the table)


def ceil_div(a, b):
    return (a + b - 1) // b


class PyAttentionInputs:
    def __init__(self, prefix_lengths, input_lengths, kv_cache_block_id_device, is_prefill=False):
        self.prefix_lengths = prefix_lengths                        # [bs] (device copy here)
        self.input_lengths = input_lengths                          # [bs] host
        self.kv_cache_block_id_device = kv_cache_block_id_device    # [bs, blocks]
        self.is_prefill = is_prefill


class PyModelInputs:
    def __init__(self, input_ids, attention_inputs):
        self.input_ids = input_ids
        self.attention_inputs = attention_inputs


class TargetModel:
    """The target model's ``forward`` (``py_forward_method_``): paged KV write, then causal attention."""

    def __init__(self, device):
        gen = generator(2)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.wq = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wk = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.wo = randn(DIM, DIM, gen=gen, device=device, scale=0.7)
        self.k_cache = torch.zeros(NUM_BLOCKS * SEQ_SIZE_PER_BLOCK, DIM, device=device)

    def forward(self, inputs):
        a = inputs.attention_inputs
        block_table = a.kv_cache_block_id_device
        bs = block_table.shape[0]
        n = inputs.input_ids.shape[0] // bs                          # tokens per request
        dev = block_table.device
        positions = a.prefix_lengths[:, None] + torch.arange(n, device=dev)[None, :]
        slots = block_table.gather(1, positions // SEQ_SIZE_PER_BLOCK) * SEQ_SIZE_PER_BLOCK \
            + positions % SEQ_SIZE_PER_BLOCK
        h = self.emb[inputs.input_ids].view(bs, n, DIM)
        self.k_cache[slots.reshape(-1)] = (h @ self.wk).reshape(-1, DIM)
        ctx = torch.arange(block_table.shape[1] * SEQ_SIZE_PER_BLOCK, device=dev)
        ctx_slots = block_table[:, ctx // SEQ_SIZE_PER_BLOCK] * SEQ_SIZE_PER_BLOCK + ctx % SEQ_SIZE_PER_BLOCK
        keys = self.k_cache[ctx_slots]                               # [bs, ctx, DIM]
        scores = (h @ self.wq) @ keys.transpose(1, 2)                # [bs, n, ctx]
        scores = scores.masked_fill(ctx[None, None, :] > positions[:, :, None], -1e9)
        out = torch.softmax(scores, -1) @ keys
        return (out @ self.wo).reshape(bs * n, DIM)


class CudaGraphRunner:
    def __init__(self, model, device, variant):
        self.py_forward_method_ = model.forward
        self.device, self.variant = device, variant
        self.max_bs_, self.max_seq_len_ = MAX_BS, MAX_SEQ_LEN
        self.seq_size_per_block_, self.num_tokens_per_bs_ = SEQ_SIZE_PER_BLOCK, NUM_TOKENS_PER_BS
        self.is_prefill_cuda_graph_mode_ = False
        self.k_cache = model.k_cache
        self.graph_instances_: dict[int, tuple] = {}
        self.capture_inputs = self.initCaptureAttentionInputs()
        self.captureDecode()

    def initCaptureAttentionInputs(self):
        max_bs = self.max_bs_
        blocks = ceil_div(self.max_seq_len_, self.seq_size_per_block_)
        if self.variant == "fix":
            blocks += 1                       # room for the verify tokens past max_seq_len
        kv_cache_block_id_device = torch.zeros(max_bs, blocks, dtype=torch.long, device=self.device)
        if self.num_tokens_per_bs_ > 1 and not self.is_prefill_cuda_graph_mode_:
            dummy = (self.max_seq_len_ - 1 if self.variant == "bug"
                     else self.max_seq_len_ + self.num_tokens_per_bs_)
            prefix_lengths = torch.full((max_bs,), dummy, dtype=torch.long, device=self.device)
        else:
            prefix_lengths = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        input_ids = torch.zeros(max_bs * self.num_tokens_per_bs_, dtype=torch.long, device=self.device)
        input_lengths = torch.full((max_bs,), self.num_tokens_per_bs_, dtype=torch.long)
        return PyModelInputs(input_ids, PyAttentionInputs(prefix_lengths, input_lengths, kv_cache_block_id_device))

    def prepareCaptureInputs(self, bs):
        c = self.capture_inputs
        a = c.attention_inputs
        return PyModelInputs(c.input_ids[:bs * self.num_tokens_per_bs_],
                             PyAttentionInputs(a.prefix_lengths[:bs], a.input_lengths[:bs],
                                               a.kv_cache_block_id_device[:bs]))

    def captureDecode(self):
        for bs in [self.max_bs_]:
            inputs = self.prepareCaptureInputs(bs)
            a = inputs.attention_inputs
            graph, output = capture(lambda: self.py_forward_method_(inputs), device=self.device, warmups=1,
                                    name=f"bs {bs}", owner="CudaGraphRunner (spec-decode target graph)",
                                    static={"input_ids": inputs.input_ids, "prefix_lengths": a.prefix_lengths,
                                            "kv_cache_block_id_device": a.kv_cache_block_id_device},
                                    state={"k_cache": self.k_cache})
            self.graph_instances_[bs] = (inputs, graph, output)

    def canRun(self, inputs):
        a = inputs.attention_inputs
        if not self.is_prefill_cuda_graph_mode_ and int(a.prefix_lengths[0]) > 0:
            if all(int(x) == self.num_tokens_per_bs_ for x in a.input_lengths) and self.num_tokens_per_bs_ > 1:
                return True
        return False

    @staticmethod
    def copySmallerIntoLarger(source_tensor, target_tensor):
        if source_tensor.dim() != target_tensor.dim():
            raise RuntimeError("Error: Source and target tensors must have the same number of dimensions.")
        for i in range(source_tensor.dim()):
            if source_tensor.size(i) > target_tensor.size(i):
                raise RuntimeError(
                    f"Error: Target tensor dimension {i} ({target_tensor.size(i)}) is smaller than source tensor "
                    f"dimension {i} ({source_tensor.size(i)}). This violates the function's guarantee.")
        target_slice = target_tensor
        for i in range(source_tensor.dim()):
            target_slice = target_slice.narrow(i, 0, source_tensor.size(i))
        target_slice.copy_(source_tensor)

    def prepareInputs(self, inputs, bs):
        py_model_inputs_ = self.graph_instances_[bs][0]
        a, ca = inputs.attention_inputs, py_model_inputs_.attention_inputs
        # clear kv_cache_block_id_device, otherwise it will cause the cache block pollution
        ca.kv_cache_block_id_device.fill_(0)
        ca.prefix_lengths[:bs].copy_(a.prefix_lengths)
        py_model_inputs_.input_ids.fill_(0)
        py_model_inputs_.input_ids[:inputs.input_ids.shape[0]].copy_(inputs.input_ids)
        self.copySmallerIntoLarger(a.kv_cache_block_id_device, ca.kv_cache_block_id_device)

    def forward(self, inputs):
        if not self.canRun(inputs):
            return self.py_forward_method_(inputs).clone()          # normalForward
        bs = inputs.attention_inputs.prefix_lengths.shape[0]
        self.prepareInputs(inputs, bs)
        _, graph, output = self.graph_instances_[bs]
        return replay(graph, output)[:inputs.input_ids.shape[0]].clone()


def run(variant: str, device: str = "cpu"):
    blocks = [[1, 2, 3], [4, 5, 6]]                 # the KV blocks of requests A and B

    def batch(prefix, token_ids):
        n = len(token_ids[0])
        width = ceil_div(prefix + n, SEQ_SIZE_PER_BLOCK)
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(device)  # noqa: E731
        return PyModelInputs(t([tok for ids in token_ids for tok in ids]),
                             PyAttentionInputs(t([prefix] * len(token_ids)),
                                               torch.tensor([n] * len(token_ids)),
                                               t([b[:width] for b in blocks]), is_prefill=prefix == 0))

    steps = [batch(0, [[3, 5, 7], [9, 2, 4]]),      # prefill (normalForward)
             batch(3, [[11, 12], [13, 14]]),        # verify 2 draft tokens per request
             batch(5, [[6, 10], [15, 1]]),
             batch(7, [[8, 0], [2, 9]])]            # positions 7, 8: the third KV block

    def serve(graphed: bool):
        model = TargetModel(device)
        if not graphed:
            return [model.forward(s).clone() for s in steps]
        runner = CudaGraphRunner(model, device, variant)
        return [runner.forward(s) for s in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
