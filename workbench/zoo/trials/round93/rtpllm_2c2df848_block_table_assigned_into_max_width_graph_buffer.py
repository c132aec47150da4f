"""rtp-llm's C++ CudaGraphRunner copies each decode batch's KV block table into the capture-time block-table buffer, which is as wide as the longest sequence allowed, by whole-row assignment: once a running sequence spans more than one KV block (but fewer than the captured width) the copy cannot broadcast and the decode step fails.

Upstream: https://github.com/alibaba/rtp-llm/commit/2c2df848b24a506b80110ad50b440e3582c7bbba ("fix large sequence
for cuda graph", alibaba/rtp-llm, committed 2025-07-30; no PR number or description, the commit message is the title).
Read: the commit's full diff: ``CudaGraphRunner::prepareInputs`` replaces
``py_model_inputs_.attention_inputs.kv_cache_block_id_device.slice(0, 0, current_batch_size_) =
inputs.attention_inputs.kv_cache_block_id_device`` with a new ``copySmallerIntoLarger`` (check every dim fits, copy into
the leading slice of each dim), takes ``py_model_inputs_`` by reference, and calls ``refreshFlashInferBuf`` (made
public) after ``fillFlashInfer``; it also stops passing ``enable_cuda_graph`` to ``genPlan`` and frees the runner in
``~CudaDevice``. Read the pre-fix files: ``CudaGraphRunner.cc`` (``initCapture``: ``kv_cache_block_id_device`` is
``[max_bs_, ceil(max_seq_len_ / seq_size_per_block_)]`` zeros, "we capture the max_block_ids"; ``capture`` from the
largest batch size down; ``captureOneBatchSize``: two warmups, the capture, then the ``FlashInferAttnParams`` taken
from the private cache or ``get`` + ``recycle``; ``forward``/``canRun``/``replay``; ``getBatchSizesToCapture``:
every size 1..32), ``CudaFlashInfer.cc`` (``create``/``get``/``recycle`` over ``ParamsCache``, one host and one device
buffer per params object split into ``page_indptr``/``qo_indptr``/``batch_indice``/``positions``/``kvlen``/
``paged_kv_last_page_len``/``page_indice``, ``fillFlashInfer``, ``refreshFlashInferBuf``, ``prepare``),
``FlashInferOp.cc`` (``FlashInferDecodeOp::prepare``/``forward``) and ``models_py/modules/fmha.py`` (the decode impl
prepares its params when built, in the python forward). Reconstructed: the symptom (the commit names only "large
sequence"): in C++ ``tensor.slice(...) = other`` on a temporary is ``copy_``, which broadcasts, so a block table one
block wide fills the row and a table as wide as the buffer fits, but any width in between raises.
Symptom: decode with the C++ CUDA graph enabled fails as soon as a batch's longest sequence needs a second KV block
(and fewer blocks than ``max_seq_len`` would need): ``copy_``'s broadcast error ("The expanded size of the tensor (4)
must match the existing size (2) at non-singleton dimension 1") from ``prepareInputs``. Short sequences (one block) and
the eager path work.
Mechanism: the capture allocates one block-table buffer ``[max_bs, max_blocks]`` sized for ``max_seq_len`` and the
graphs read the rows of their batch size through a view of it. Each decode batch brings a block table only as wide as
its longest sequence. Copying it by whole-row assignment asks ``copy_`` to broadcast ``[bs, n]`` into
``[bs, max_blocks]``; that succeeds for n = 1 (the block id is repeated across the row) and for n = max_blocks, and
raises otherwise. The eager path reads the batch's own block table and never meets the static width.
Doctor: padded-shape-mismatch, at prepareInputs. The runner code at the graph's padded width (the captured block-table
buffer's max_blocks columns) combines it with a tensor sized for the real batch (its own block count), and the
mismatch surfaces as the copy's shape error.
Fix (upstream): ``copySmallerIntoLarger``: check the source fits and copy it into the leading ``[bs, n]`` corner; also
``refreshFlashInferBuf`` after ``fillFlashInfer`` (in this program the FlashInfer device buffers are already refreshed
by the host-to-device copy recorded during capture, which re-reads the staging buffer at every replay, so that call
changes nothing here; both are switched by the variant). The ``genPlan`` flag and the destructor are not modelled.
Modelled: ``CudaGraphRunner`` (``initCapture``, ``capture``, ``captureOneBatchSize``, ``prepareInputs``,
``copySmallerIntoLarger``, ``canRun``, ``forward``, ``replay``, ``getBatchSizesToCapture``), ``FlashInferAttnParams``
(``create``/``get``/``recycle``/``prepare``/``fillFlashInfer``/``refreshFlashInferBuf`` with host staging buffers and
device buffers), ``ParamsCache``, ``FlashInferDecodeOp`` and ``FlashInferDecodeImpl`` (params prepared in the python
forward), ``PyModelInputs``/``PyAttentionInputs``. Stand-ins: ``BatchDecodeWithPagedKVCacheRun`` is a paged softmax
attention over ``page_indptr``/``page_indice``/``paged_kv_last_page_len``; ``FusedRopeKVCacheDecodeOp`` adds a position
embedding and writes K/V at ``kv_cache_block_id_device[b, pos // block]``; the model is one attention layer (hidden 8,
vocab 16, float64) with a greedy sampler outside the graph; no plan (``genPlan``) is computed.
Workload: seq_size_per_block 4, max_seq_len 16 (a captured width of 4 blocks), capture sizes 1..4. Three requests
(prompts of 3, 2 and 3 tokens, one block each) decode 5 greedy steps at batch size 3 (a captured size: no padding).
Step 0 fits in one block and the bug equals eager there (the row is filled by broadcast); at step 1 requests A and C
need a second block and the bug raises "The expanded size of the tensor (4) must match the existing size (2) at
non-singleton dimension 1. Target sizes: [3, 4]. Tensor sizes: [3, 2]". The fix equals eager on all five steps
(max error 0).
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import graph_pool_handle, host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/2c2df848b24a506b80110ad50b440e3582c7bbba"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "prepareInputs"
SYMPTOM = ("C++ CUDA-graph decode fails once a sequence spans a second KV block: the batch's block table is assigned "
           "whole-row into the capture-time max-width block-table buffer and cannot broadcast")

HIDDEN, VOCAB = 8, 16
SEQ_SIZE_PER_BLOCK = 4
MAX_SEQ_LEN = 16
NUM_BLOCKS = 16
CONCURRENCY_LIMIT = 4
NUM_TOKENS_PER_BS = 1
MIN_CACHE_BATCH_SIZE = 8
MIN_CACHE_INPUT_TOKEN_NUM = 8
MIN_CACHE_PAGE_NUM = 32

_variant = "bug"


# --- rtp_llm/cpp/devices/cuda_impl/CudaFlashInfer.cc ------------------------------------------------------------------

class ParamsCache:
    DECODE_PARAMS_CACHE: list = []


class FlashInferAttnParams:
    """One host (pinned) and one device int32 buffer, each split into the seven FlashInfer arrays."""

    @staticmethod
    def get(batch_size, input_token_num):
        cache = ParamsCache.DECODE_PARAMS_CACHE
        if cache:
            params = cache.pop()
            if batch_size <= params.batch_size and input_token_num <= params.input_token_num:
                return params
        return None

    @staticmethod
    def recycle(params):
        ParamsCache.DECODE_PARAMS_CACHE.append(params)

    @staticmethod
    def create(device, batch_size, input_token_num, page_num):
        params = FlashInferAttnParams.get(batch_size, input_token_num)
        if params is not None:
            return params
        params = FlashInferAttnParams()
        params.batch_size, params.input_token_num, params.page_num = batch_size, input_token_num, page_num
        shapes = {"page_indptr": batch_size + 1, "qo_indptr": batch_size + 1, "batch_indice": input_token_num,
                  "positions": input_token_num, "kvlen": batch_size, "paged_kv_last_page_len": batch_size,
                  "page_indice": page_num}
        total = sum(shapes.values())
        params.buf_h = host(torch.zeros(total, dtype=torch.int32), device)
        params.buf_d = torch.zeros(total, dtype=torch.int32, device=device)
        offset = 0
        for name, size in shapes.items():
            setattr(params, f"{name}_h", params.buf_h[offset:offset + size])
            setattr(params, f"{name}_d", params.buf_d[offset:offset + size])
            offset += size
        return params

    def fillFlashInfer(self, prefix_lengths_host, sequence_lengths_host, input_lengths_host, kv_cache_block_id_host,
                       batch_size, tokens_per_block):
        assert batch_size <= self.batch_size, f"batch_size exceed reserved {batch_size} > {self.batch_size}"
        # the host arrays are written through their memory, as upstream writes through data_ptr<int>()
        qo_indptr, page_indptr = self.qo_indptr_h.numpy(), self.page_indptr_h.numpy()
        batch_indice, positions = self.batch_indice_h.numpy(), self.positions_h.numpy()
        paged_kv_last_page_len, kvlen = self.paged_kv_last_page_len_h.numpy(), self.kvlen_h.numpy()
        page_indice = self.page_indice_h.numpy()
        sequence_lengths = sequence_lengths_host.tolist()
        kv_cache_block_id = kv_cache_block_id_host.tolist()
        total_page_idx = 0
        accu_q_len = 0
        qo_indptr[0] = 0
        page_indptr[0] = 0
        for i in range(batch_size):                       # decode: one new token per request
            batch_indice[i] = i
            positions[i] = sequence_lengths[i]
            seq_len = sequence_lengths[i] + 1
            accu_q_len += 1
            paged_kv_last_page_len[i] = (seq_len - 1) % tokens_per_block + 1
            kvlen[i] = seq_len
            page_num = (seq_len + tokens_per_block - 1) // tokens_per_block
            assert total_page_idx + page_num <= self.page_num, "page_num exceed reserved"
            for j in range(page_num):
                page_indice[total_page_idx] = kv_cache_block_id[i][j]
                total_page_idx += 1
            page_indptr[i + 1] = total_page_idx
            qo_indptr[i + 1] = accu_q_len

    def refreshFlashInferBuf(self, device, batch_size, input_token_num):
        self.buf_d.copy_(self.buf_h, non_blocking=True)    # cudaMemcpyAsync(buf_d, buf_h, H2D, stream)

    @staticmethod
    def prepare(device, sequence_lengths_host, input_lengths_host, kv_cache_block_id_host):
        batch_size = input_lengths_host.shape[0]
        input_token_num = input_lengths_host.shape[0]
        params = FlashInferAttnParams.create(device, max(MIN_CACHE_BATCH_SIZE, batch_size),
                                             max(MIN_CACHE_INPUT_TOKEN_NUM, input_token_num), MIN_CACHE_PAGE_NUM)
        params.fillFlashInfer(None, sequence_lengths_host, input_lengths_host, kv_cache_block_id_host, batch_size,
                              SEQ_SIZE_PER_BLOCK)
        params.refreshFlashInferBuf(device, batch_size, input_token_num)
        return params


def BatchDecodeWithPagedKVCacheRun(q, paged_k_cache, paged_v_cache, paged_kv_indptr, paged_kv_indices,
                                   paged_kv_last_page_len, softmax_scale):
    bs = q.shape[0]
    max_pages = MAX_SEQ_LEN // SEQ_SIZE_PER_BLOCK
    starts = paged_kv_indptr[:bs].long()
    num_pages = paged_kv_indptr[1:bs + 1].long() - starts                                  # [bs]
    cols = torch.arange(max_pages, device=q.device)
    idx = (starts.unsqueeze(1) + cols.unsqueeze(0)).clamp(max=paged_kv_indices.shape[0] - 1)
    pages = paged_kv_indices[idx].long()                                                     # [bs, P]
    keys = paged_k_cache[pages].reshape(bs, max_pages * SEQ_SIZE_PER_BLOCK, -1)
    vals = paged_v_cache[pages].reshape(bs, max_pages * SEQ_SIZE_PER_BLOCK, -1)
    kv_len = (num_pages - 1) * SEQ_SIZE_PER_BLOCK + paged_kv_last_page_len[:bs].long()
    tok = torch.arange(max_pages * SEQ_SIZE_PER_BLOCK, device=q.device)
    valid = tok.unsqueeze(0) < kv_len.unsqueeze(1)
    scores = ((keys * q.unsqueeze(1)).sum(-1) * softmax_scale).masked_fill(~valid, float("-inf"))
    return (torch.softmax(scores, -1).unsqueeze(-1) * vals).sum(1)


# --- rtp_llm/models_py (the python model the runner captures) ---------------------------------------------------------

@dataclasses.dataclass
class PyAttentionInputs:
    is_prefill: bool
    input_lengths: torch.Tensor              # host
    sequence_lengths: torch.Tensor           # host (pinned)
    kv_cache_block_id_host: torch.Tensor
    kv_cache_block_id_device: torch.Tensor


@dataclasses.dataclass
class PyModelInputs:
    input_ids: torch.Tensor
    attention_inputs: PyAttentionInputs


@dataclasses.dataclass
class PyModelOutputs:
    hidden_states: torch.Tensor


class FlashInferDecodeOp:
    def __init__(self, device):
        self.device = device

    def prepare(self, attn_inputs: PyAttentionInputs):
        return FlashInferAttnParams.prepare(self.device, attn_inputs.sequence_lengths, attn_inputs.input_lengths,
                                            attn_inputs.kv_cache_block_id_host)

    def forward(self, q, kv_cache, params):
        k_cache, v_cache = kv_cache
        return BatchDecodeWithPagedKVCacheRun(q, k_cache, v_cache, params.page_indptr_d, params.page_indice_d,
                                              params.paged_kv_last_page_len_d, HIDDEN ** -0.5)


class FusedRopeKVCacheDecodeOp:
    """Stand-in: a position embedding for q/k, then the new K/V written into its paged slot."""

    def __init__(self, pos_emb):
        self.pos_emb = pos_emb

    def forward(self, q, k, v, kv_cache, attn_inputs, params):
        k_cache, v_cache = kv_cache
        bs = q.shape[0]
        pos = params.positions_d[:bs].long()
        q, k = q + self.pos_emb[pos], k + self.pos_emb[pos]
        block = attn_inputs.kv_cache_block_id_device[torch.arange(bs, device=q.device), pos // SEQ_SIZE_PER_BLOCK]
        k_cache[block.long(), pos % SEQ_SIZE_PER_BLOCK] = k
        v_cache[block.long(), pos % SEQ_SIZE_PER_BLOCK] = v
        return q


class FlashInferDecodeImpl:
    """FMHADecodeImplBase: the params are prepared when the impl is built (in every python forward)."""

    def __init__(self, op: FlashInferDecodeOp, rope: FusedRopeKVCacheDecodeOp, attn_inputs: PyAttentionInputs):
        self.fmha_impl, self.rope_kvcache_impl, self.attn_inputs = op, rope, attn_inputs
        self.fmha_params = self.fmha_impl.prepare(attn_inputs)

    def forward(self, q, k, v, kv_cache):
        q = self.rope_kvcache_impl.forward(q, k, v, kv_cache, self.attn_inputs, self.fmha_params)
        res = self.fmha_impl.forward(q, kv_cache, self.fmha_params)
        FlashInferAttnParams.recycle(self.fmha_params)    # ParamsPtr's deleter when the impl goes away
        return res


class GptModel:
    def __init__(self, device):
        gen = generator(2025730)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.device = device
        self.embed = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_emb = r(MAX_SEQ_LEN, HIDDEN, scale=0.3)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.k_cache = torch.zeros(NUM_BLOCKS, SEQ_SIZE_PER_BLOCK, HIDDEN, dtype=torch.float64, device=device)
        self.v_cache = torch.zeros(NUM_BLOCKS, SEQ_SIZE_PER_BLOCK, HIDDEN, dtype=torch.float64, device=device)
        self.decode_op = FlashInferDecodeOp(device)
        self.rope_op = FusedRopeKVCacheDecodeOp(self.pos_emb)

    def forward(self, inputs: PyModelInputs) -> PyModelOutputs:
        fmha = FlashInferDecodeImpl(self.decode_op, self.rope_op, inputs.attention_inputs)
        x = self.embed[inputs.input_ids.long()]
        o = fmha.forward(x @ self.wq, x @ self.wk, x @ self.wv, (self.k_cache, self.v_cache))
        return PyModelOutputs(hidden_states=x + o @ self.wo)


# --- rtp_llm/cpp/devices/cuda_impl/CudaGraphRunner.cc -----------------------------------------------------------------

class CaptureMemoryHold:
    def __init__(self, hidden_states, inputs: PyModelInputs):
        self.decoder_layer_hidden_states_ = hidden_states
        self.py_model_inputs_ = inputs
        self.params_ = None


class GraphInstance:
    def __init__(self):
        self.graph_ = None
        self.mem_hold_ = None


class CudaGraphRunner:
    PRIVATE_DECODE_PARAMS_CACHE: list = []

    def __init__(self, py_instance: GptModel, device):
        self.py_forward_method_ = py_instance.forward
        self.device = device
        self.concurrency_limit_ = CONCURRENCY_LIMIT
        self.num_tokens_per_bs_ = NUM_TOKENS_PER_BS
        self.max_seq_len_ = MAX_SEQ_LEN
        self.seq_size_per_block_ = SEQ_SIZE_PER_BLOCK
        self.graph_instances_ = {}
        self.current_batch_size_ = 1
        self.current_real_graph_bs_ = 1
        self.k_cache, self.v_cache = py_instance.k_cache, py_instance.v_cache
        self.initCapture()

    def getBatchSizesToCapture(self, concurrency_limit):
        return list(range(1, min(32, concurrency_limit) + 1))

    def initCapture(self):
        self.capture_range_ = self.getBatchSizesToCapture(self.concurrency_limit_)
        self.max_bs_ = max(self.capture_range_)
        self.max_num_token_ = self.max_bs_ * self.num_tokens_per_bs_
        output = torch.zeros(self.max_num_token_, HIDDEN, dtype=torch.float64, device=self.device)
        max_blocks = (self.max_seq_len_ + self.seq_size_per_block_ - 1) // self.seq_size_per_block_
        inputs = PyModelInputs(
            input_ids=torch.zeros(self.max_num_token_, dtype=torch.int32, device=self.device),
            attention_inputs=PyAttentionInputs(
                is_prefill=False,
                input_lengths=host(torch.ones(self.max_bs_, dtype=torch.int32), self.device),
                sequence_lengths=host(torch.ones(self.max_bs_, dtype=torch.int32), self.device),
                # kv_cache_block_id_device [batch_size, block_num]
                kv_cache_block_id_device=torch.zeros(self.max_bs_, max_blocks, dtype=torch.int32, device=self.device),
                kv_cache_block_id_host=host(torch.zeros(self.max_bs_, max_blocks, dtype=torch.int32), self.device)))
        self.capture_mem_hold_ = CaptureMemoryHold(output, inputs)
        self.pool = graph_pool_handle(self.device)
        self.capture()

    def capture(self):
        full = self.capture_mem_hold_.py_model_inputs_.attention_inputs
        for bs in reversed(self.capture_range_):
            inputs = PyModelInputs(
                input_ids=self.capture_mem_hold_.py_model_inputs_.input_ids[:bs * self.num_tokens_per_bs_],
                attention_inputs=PyAttentionInputs(
                    is_prefill=False, input_lengths=full.input_lengths[:bs],
                    sequence_lengths=full.sequence_lengths[:bs],
                    # we capture the max_block_ids
                    kv_cache_block_id_device=full.kv_cache_block_id_device[:bs],
                    kv_cache_block_id_host=full.kv_cache_block_id_host[:bs]))
            instance = GraphInstance()
            instance.mem_hold_ = CaptureMemoryHold(
                self.capture_mem_hold_.decoder_layer_hidden_states_[:bs * self.num_tokens_per_bs_], inputs)
            self.graph_instances_[bs] = instance
            self.captureOneBatchSize(bs)

    def captureOneBatchSize(self, bs):
        instance = self.graph_instances_[bs]
        inputs = instance.mem_hold_.py_model_inputs_

        def forward_once():
            outputs = self.py_forward_method_(inputs)
            instance.mem_hold_.decoder_layer_hidden_states_.copy_(outputs.hidden_states)
            return instance.mem_hold_.decoder_layer_hidden_states_

        # WarmUp twice, then capture
        instance.graph_, _ = capture(
            forward_once, device=self.device, pool=self.pool, warmups=2, name=f"decode bs={bs}",
            owner="CudaGraphRunner",
            static={"input_ids": self.capture_mem_hold_.py_model_inputs_.input_ids,
                    "kv_cache_block_id_device":
                        self.capture_mem_hold_.py_model_inputs_.attention_inputs.kv_cache_block_id_device},
            state={"k_cache": self.k_cache, "v_cache": self.v_cache})
        # retrieve from private cache first
        params = self.PRIVATE_DECODE_PARAMS_CACHE[-1] if self.PRIVATE_DECODE_PARAMS_CACHE else None
        if params is None:
            params = FlashInferAttnParams.get(MIN_CACHE_BATCH_SIZE, MIN_CACHE_INPUT_TOKEN_NUM)
            FlashInferAttnParams.recycle(params)
            self.PRIVATE_DECODE_PARAMS_CACHE.append(params)
        instance.mem_hold_.params_ = params

    def copySmallerIntoLarger(self, source_tensor, target_tensor):
        if source_tensor.dim() != target_tensor.dim():
            raise RuntimeError("Error: Source and target tensors must have the same number of dimensions.")
        for i in range(source_tensor.dim()):
            if source_tensor.shape[i] > target_tensor.shape[i]:
                raise RuntimeError(f"Error: Target tensor dimension {i} ({target_tensor.shape[i]}) is smaller than "
                                   f"source tensor dimension {i} ({source_tensor.shape[i]}).")
        target_slice = target_tensor
        for i in range(source_tensor.dim()):
            target_slice = target_slice.narrow(i, 0, source_tensor.shape[i])
        target_slice.copy_(source_tensor)

    def prepareInputs(self, inputs: PyModelInputs):
        instance = self.graph_instances_[self.current_real_graph_bs_]
        py_model_inputs_ = instance.mem_hold_.py_model_inputs_
        bs = self.current_batch_size_
        py_model_inputs_.input_ids.fill_(0)
        py_model_inputs_.input_ids[:bs * self.num_tokens_per_bs_] = inputs.input_ids
        py_model_inputs_.attention_inputs.input_lengths[:bs] = inputs.attention_inputs.input_lengths
        py_model_inputs_.attention_inputs.sequence_lengths[:bs] = inputs.attention_inputs.sequence_lengths
        if _variant == "fix":
            self.copySmallerIntoLarger(inputs.attention_inputs.kv_cache_block_id_device,
                                       py_model_inputs_.attention_inputs.kv_cache_block_id_device)
        else:
            py_model_inputs_.attention_inputs.kv_cache_block_id_device[:bs] = \
                inputs.attention_inputs.kv_cache_block_id_device
        instance.mem_hold_.params_.fillFlashInfer(
            None, inputs.attention_inputs.sequence_lengths, inputs.attention_inputs.input_lengths,
            inputs.attention_inputs.kv_cache_block_id_host, bs, self.seq_size_per_block_)
        if _variant == "fix":
            instance.mem_hold_.params_.refreshFlashInferBuf(
                self.device, bs, inputs.attention_inputs.input_lengths.shape[0])

    def canRun(self, inputs: PyModelInputs):
        cuda_graph_bs = inputs.attention_inputs.sequence_lengths.shape[0]
        self.current_batch_size_ = cuda_graph_bs
        is_bs_supported = cuda_graph_bs <= self.max_bs_
        if is_bs_supported:
            self.current_real_graph_bs_ = next(b for b in self.capture_range_ if b >= cuda_graph_bs)
        return is_bs_supported

    def forward(self, inputs: PyModelInputs) -> PyModelOutputs:
        if not inputs.attention_inputs.is_prefill and self.canRun(inputs):
            self.prepareInputs(inputs)
            hidden = self.replay(self.current_real_graph_bs_)
            return PyModelOutputs(hidden_states=hidden)
        return self.py_forward_method_(inputs)

    def replay(self, bs):
        instance = self.graph_instances_[bs]
        out = instance.mem_hold_.decoder_layer_hidden_states_
        return replay(instance.graph_, out, real=self.current_batch_size_ * self.num_tokens_per_bs_, size=out.shape[0])


# --- the workload -----------------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = [3, 2, 3]
    first_tokens = [5, 9, 2]
    num_steps = 5

    def serve(use_cuda_graph):
        ParamsCache.DECODE_PARAMS_CACHE = []
        CudaGraphRunner.PRIVATE_DECODE_PARAMS_CACHE = []
        model = GptModel(device)
        runner = CudaGraphRunner(model, device) if use_cuda_graph else None   # captured at startup
        gen = generator(20250730)
        blocks, next_block = [], 1                          # block 0: never handed out
        for plen in prompts:                                # prefill stand-in: the prompts' K/V in their blocks
            blocks.append([next_block])
            model.k_cache[next_block, :plen] = randn(plen, HIDDEN, gen=gen, device=device).double()
            model.v_cache[next_block, :plen] = randn(plen, HIDDEN, gen=gen, device=device).double()
            next_block += 1
        seq_lens = list(prompts)
        tokens = torch.tensor(first_tokens, dtype=torch.int32, device=device)
        outs = []
        for _ in range(num_steps):
            for b, s in enumerate(seq_lens):                # the KV-cache manager grows each block list
                while len(blocks[b]) * SEQ_SIZE_PER_BLOCK < s + 1:
                    blocks[b].append(next_block)
                    next_block += 1
            width = max(len(bl) for bl in blocks)
            block_ids = torch.tensor([bl + [0] * (width - len(bl)) for bl in blocks], dtype=torch.int32)
            bs = len(prompts)
            inputs = PyModelInputs(
                input_ids=tokens,
                attention_inputs=PyAttentionInputs(
                    is_prefill=False, input_lengths=host(torch.ones(bs, dtype=torch.int32), device),
                    sequence_lengths=host(torch.tensor(seq_lens, dtype=torch.int32), device),
                    kv_cache_block_id_host=host(block_ids, device),
                    kv_cache_block_id_device=block_ids.to(device)))
            if runner is not None:
                hidden = runner.forward(inputs).hidden_states[:bs]
            else:
                hidden = model.forward(inputs).hidden_states
            logits = hidden @ model.lm_head
            outs.append(logits.clone())
            tokens = torch.tensor(logits.argmax(-1).tolist(), dtype=torch.int32, device=device)   # greedy sampler
            seq_lens = [s + 1 for s in seq_lens]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
