"""rtp-llm decode CUDA graph with a kernel block size smaller than the KV-cache block size: the graph's static block table is sized in physical KV blocks while the block tables the attention kernels read are in kernel blocks, so a request past a short length no longer fits the captured table.

Upstream: https://github.com/alibaba/rtp-llm/commit/a3dfef8d830e583fd6d380eab1bdef0daa0a35d1 ("fix: kernel_block_size
cuda graph support", alibaba/rtp-llm, author 蝉吟 <liudu.ld@alibaba-inc.com>, committed 2026-03-12, a direct commit
on main, no PR). Read: the whole diff (``rtp_llm/cpp/devices/GraphBase.h`` new ``GraphParams::kernel_tokens_per_block``,
``CudaGraphRunner.h`` new ``kernel_seq_size_per_block_`` and its constructor check, ``CudaGraphRunner.cc``
``initCaptureAttentionInputs``, ``PyWrappedModel.h`` passing ``device_params.kernel_tokens_per_block`` into the graph
params, and the test helpers ``CudaGraphDecodePadding.py`` / ``CudaGraphPrefill.py`` / ``cuda_graph_test_utils.py``
switched to kernel-block-sized block tables); and, at the parent commit, ``CudaGraphRunner.cc`` (``prepareInputs``,
``copySmallerIntoLarger``, ``forward``, ``canRun``, ``tryGetRealGraphDecodeBatchSize``, ``initCaptureAttentionInputs``,
``initCapture``, ``captureOneGraphInstance``, ``prepareCaptureInputs``), ``CudaGraphDecode.cc`` (``captureDecode``),
``PyWrappedModel.cc`` (``setupKVCacheForAttentionInputs``, the ``canRun`` / graph ``forward`` / normal forward
branch), ``cache/KVCacheResource.cc`` (``BlockIds::add``, ``updateKernelSlotAt``: each physical block ``b`` expands
to kernel blocks ``b * bpk + j``), ``cache/CacheConfig.h`` (``kernel_blocks_per_kv_block = seq_size_per_block /
kernel_seq_size_per_block``) and ``devices/OpData.h`` (``kv_cache_block_id`` is ``[group, batch, block_nums *
kernel_blocks_per_kv_block]``, kernel-granularity ids for attention). Also read: the follow-up commit ccce95aa2
("fix: kernel block for cache store", 2026-03-15), whose ``CudaGraphRunner.cc`` hunks only rename the static tables
``kv_cache_kernel_block_id_*`` and keep the kernel-block sizing.
Symptom: the commit message is its title only. As the diff implies (and as modelled): with ``kernel_tokens_per_block``
smaller than ``tokens_per_block`` and decode CUDA graphs on, the first decode step whose batch holds a request of more
than ``ceil(max_seq_len / tokens_per_block) / bpk`` physical blocks fails in ``prepareInputs``
(``copySmallerIntoLarger`` throws "Target tensor dimension 1 ... is smaller than source tensor dimension 1"); eager
serving (graphs off) is fine.
Mechanism: ``PyWrappedModel::setupKVCacheForAttentionInputs`` hands the model the batch's kernel-granularity block
table (``BlockIds::kernelBlocks``: ``bpk`` kernel ids per physical block). ``initCaptureAttentionInputs`` sized the
graph's static ``kv_cache_block_id_device`` / ``_host`` as ``[max_bs, ceil(max_seq_len / seq_size_per_block_) +
sp_steps_]``, a count of physical blocks, and the runner did not know the kernel block size at all. Before every
replay ``prepareInputs`` clears the static table and copies the batch's table into it with
``copySmallerIntoLarger``, which throws once the batch's table is wider than the captured one: here as soon as a
request needs a second physical block (4 kernel columns against 3).
Doctor: undersized-buffer, at initCaptureAttentionInputs. The step's block table does not fit the graph's static
block-table buffer, because ``initCaptureAttentionInputs`` sizes that buffer in physical blocks, and the upstream fix
is in ``initCaptureAttentionInputs`` (size it in kernel blocks).
Fix (upstream): ``GraphParams`` gains ``kernel_tokens_per_block`` (``PyWrappedModel`` passes the device's),
``CudaGraphRunner`` keeps it as ``kernel_seq_size_per_block_`` (and throws if it is not positive), and
``initCaptureAttentionInputs`` sizes the static block tables ``max_kv_blocks * seq_size_per_block_ /
kernel_seq_size_per_block_`` columns.
Modelled: ``BlockIds`` (``add``, ``updateKernelSlotAt``, ``kernelBlocks``), ``PyWrappedModel`` (block table setup,
``canRun`` then graph ``forward`` or the normal forward), ``CudaGraphRunner`` (``initCapture`` with its forward "for
output datatype", ``initCaptureAttentionInputs`` both versions, ``captureDecode`` from the largest batch size down,
``prepareCaptureInputs`` slicing the capture memory, ``captureOneGraphInstance`` with two warmups, the post-capture
replay check, ``canRun`` / ``tryGetRealGraphDecodeBatchSize``, ``prepareInputs`` with ``copySmallerIntoLarger``,
``forward``). Stand-ins: one attention layer over a kernel-block paged KV cache for the Python model (block 0 is the
null block; the capture dummies' block tables are zeros), the device ``sequence_lengths_plus_1_d`` read by the graph
for the decode position, the attention kernel reads a block-table column past the table's width as its last column
(a GPU kernel reads past the row; only the capture dummies, at ``max_seq_len - 2``, reach there), prefill eager, one
KV group, no speculative decoding (``num_tokens_per_bs = 1``, ``sp_steps = 0``), float64.
Workload: ``max_seq_len`` 12, ``tokens_per_block`` 4, ``kernel_tokens_per_block`` 2 (2 kernel blocks per physical
block), decode graphs for batch sizes 1 and 2. Requests A (prompt 3 tokens, physical blocks 1, 3, ... as needed) and
B (prompt 2, blocks 2, 4, ...) prefill together eagerly, then decode together for 5 steps; A reaches its second
physical block at decode step 2 (position 4), so the batch's table becomes 4 kernel columns wide.
Measured: the bug serves the prefill and decode step 1 (table 2 columns) and then raises RuntimeError at step 2
("Error: Target tensor dimension 1 (3) is smaller than source tensor dimension 1 (4). This violates the function's
guarantee."); the fix (static table 6 columns) replays the batch-size-2 graph for all 5 decode steps (batch tables 2,
then 4 columns wide) and equals eager (max |graph - eager| = 0 in every step: the graph's extra, masked context
positions add exact zeros).
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/alibaba/rtp-llm/commit/a3dfef8d830e583fd6d380eab1bdef0daa0a35d1"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "initCaptureAttentionInputs"
SYMPTOM = ("with kernel_tokens_per_block < tokens_per_block the decode graph's static block table is sized in physical "
           "blocks, so a batch's kernel-block table stops fitting it and prepareInputs throws")

MAX_BS, MAX_SEQ_LEN, TOKENS_PER_BLOCK, KERNEL_TOKENS_PER_BLOCK = 2, 12, 4, 2
SP_STEPS, NUM_TOKENS_PER_BS = 0, 1
DECODE_CAPTURE_BATCH_SIZES = [1, 2]
NUM_PHYSICAL_BLOCKS = 8                       # physical block 0 (kernel blocks 0, 1) is the null block
VOCAB, HIDDEN = 16, 8
DTYPE = torch.float64
INT = torch.int64

_variant = "bug"


# --- rtp_llm/cpp/cache/KVCacheResource.cc (reduced) -------------------------------------------------------------------

class BlockIds:
    def __init__(self, kernel_blocks_per_kv_block=1):
        self.block_indices = []
        self.kernel_block_indices_ = []
        self.kernel_blocks_per_kv_block_ = max(kernel_blocks_per_kv_block, 1)

    def kernelBlocks(self):
        return self.kernel_block_indices_

    def add(self, ids):
        old_size = len(self.block_indices)
        self.block_indices += list(ids)
        self.kernel_block_indices_ += [0] * (len(ids) * self.kernel_blocks_per_kv_block_)
        for i, block in enumerate(ids):
            self.updateKernelSlotAt(old_size + i, block)

    def updateKernelSlotAt(self, pos, val):
        bpk = self.kernel_blocks_per_kv_block_
        base_pos = pos * bpk
        for j in range(bpk):
            self.kernel_block_indices_[base_pos + j] = -1 if val == -1 else val * bpk + j


# --- rtp_llm/cpp/models_py bindings (reduced) -------------------------------------------------------------------------

class PyAttentionInputs:
    def __init__(self):
        self.is_prefill = False
        self.input_lengths = None                  # [bs] host
        self.sequence_lengths = None               # [bs] host: tokens already in the KV cache
        self.sequence_lengths_plus_1_d = None      # [bs] device
        self.kv_cache_block_id_host = None         # [bs, kernel blocks] host
        self.kv_cache_block_id_device = None       # [bs, kernel blocks] device


class PyModelInputs:
    def __init__(self, input_ids=None, attention_inputs=None):
        self.input_ids = input_ids
        self.attention_inputs = attention_inputs if attention_inputs is not None else PyAttentionInputs()


class PyModelOutputs:
    def __init__(self, hidden_states):
        self.hidden_states = hidden_states


class GptModel:
    """The Python model's ``forward``: one attention layer over a paged KV cache addressed in kernel blocks."""

    def __init__(self, device):
        gen = generator(3585)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)   # noqa: E731
        self.embedding = r(VOCAB, HIDDEN, scale=1.0)
        self.pos_embedding = r(MAX_SEQ_LEN, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN), r(HIDDEN, HIDDEN)
        num_kernel_blocks = NUM_PHYSICAL_BLOCKS * (TOKENS_PER_BLOCK // KERNEL_TOKENS_PER_BLOCK)
        self.k_cache = torch.zeros(num_kernel_blocks, KERNEL_TOKENS_PER_BLOCK, HIDDEN, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, inputs, attn_pyobj=None):
        a = inputs.attention_inputs
        block_table = a.kv_cache_block_id_device
        bs, max_blocks_per_seq = block_table.shape
        dev = block_table.device
        if a.is_prefill:
            lens = a.input_lengths.tolist()
            req = torch.repeat_interleave(torch.arange(bs), torch.tensor(lens)).to(dev)
            pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        else:
            req = torch.arange(bs, device=dev)
            pos = a.sequence_lengths_plus_1_d - 1
        kb = KERNEL_TOKENS_PER_BLOCK
        col = (pos // kb).clamp(max=max_blocks_per_seq - 1)
        kernel_block = block_table[req, col]
        h = self.embedding[inputs.input_ids] + self.pos_embedding[pos]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        self.k_cache.index_put_((kernel_block, pos % kb), k)                 # fused rope / kv-cache write
        self.v_cache.index_put_((kernel_block, pos % kb), v)
        ctx = torch.arange(max_blocks_per_seq * kb, device=dev)
        ctx_blocks = block_table[req][:, ctx // kb]                            # [tokens, ctx]
        keys, values = self.k_cache[ctx_blocks, ctx % kb], self.v_cache[ctx_blocks, ctx % kb]
        scores = torch.einsum("th,tch->tc", q, keys) / math.sqrt(HIDDEN)
        scores = scores.masked_fill(ctx[None, :] > pos[:, None], float("-inf"))
        attn = torch.einsum("tc,tch->th", torch.softmax(scores, -1), values)
        return PyModelOutputs(h + attn @ self.wo)


# --- rtp_llm/cpp/devices/cuda_impl/CudaGraphRunner.cc, CudaGraphDecode.cc (March 2026, reduced) -----------------------

class CaptureMemoryHold:
    def __init__(self, hidden_states, inputs):
        self.decoder_layer_hidden_states_ = hidden_states
        self.py_model_inputs_ = inputs


class GraphInstance:
    def __init__(self):
        self.mem_hold_ = None
        self.graph_ = None


class CudaGraphState:
    def __init__(self):
        self.current_batch_size = 0
        self.current_real_graph_bs = 0
        self.seq_len_sum = 0


class CudaGraphRunner:
    def __init__(self, graph_params, py_forward_method, device):
        self.py_forward_method_ = py_forward_method
        self.device = device
        self.enable_cuda_graph_ = True
        self.max_bs_ = graph_params["max_bs"]
        self.num_tokens_per_bs_ = graph_params["num_tokens_per_bs"]
        self.max_seq_len_ = graph_params["max_seq_len"]
        self.seq_size_per_block_ = graph_params["tokens_per_block"]
        if _variant == "fix":
            self.kernel_seq_size_per_block_ = graph_params["kernel_tokens_per_block"]
            if self.kernel_seq_size_per_block_ <= 0:
                raise RuntimeError("CudaGraphRunner constructor: kernel_tokens_per_block must be > 0.")
        self.sp_steps_ = graph_params["sp_steps"]
        self.hidden_size_ = HIDDEN
        self.is_prefill_cuda_graph_mode_ = False
        self.decode_capture_batch_sizes_ = graph_params["decode_capture_batch_sizes"]
        self.kv_cache = graph_params["kv_cache"]
        self.graph_instances_: dict[int, GraphInstance] = {}
        self.capture_range_ = []
        self.capture_mem_hold_ = None

    # -- capture ------------------------------------------------------------------------------------------------------

    def initCaptureAttentionInputs(self, inputs, max_bs, num_tokens_per_bs):
        a = inputs.attention_inputs
        a.is_prefill = self.is_prefill_cuda_graph_mode_ or self.num_tokens_per_bs_ > 1
        a.input_lengths = torch.full((self.max_bs_,), self.num_tokens_per_bs_, dtype=INT)
        a.sequence_lengths = torch.full((self.max_bs_,), self.max_seq_len_ - num_tokens_per_bs - 1, dtype=INT)
        if _variant == "bug":
            max_blocks = (self.max_seq_len_ + self.seq_size_per_block_ - 1) // self.seq_size_per_block_ + self.sp_steps_
        else:
            max_kv_blocks = ((self.max_seq_len_ + self.seq_size_per_block_ - 1) // self.seq_size_per_block_
                             + self.sp_steps_)
            max_blocks = max_kv_blocks * self.seq_size_per_block_ // self.kernel_seq_size_per_block_
        # kv_cache_block_id_device [batch_size, block_num]
        a.kv_cache_block_id_device = torch.zeros(self.max_bs_, max_blocks, dtype=INT, device=self.device)
        a.kv_cache_block_id_host = torch.zeros(self.max_bs_, max_blocks, dtype=INT)
        a.sequence_lengths_plus_1_d = (a.sequence_lengths + 1).to(self.device)

    def initCapture(self):
        self.max_num_token_ = self.max_bs_ * self.num_tokens_per_bs_
        self.capture_range_ = sorted(self.decode_capture_batch_sizes_)
        inputs = PyModelInputs(torch.zeros(self.max_num_token_, dtype=INT, device=self.device))
        self.initCaptureAttentionInputs(inputs, self.max_bs_, self.num_tokens_per_bs_)
        self.capture_mem_hold_ = CaptureMemoryHold(None, inputs)
        self.py_forward_method_(self.capture_mem_hold_.py_model_inputs_)        # forward for output datatype
        self.capture_mem_hold_.decoder_layer_hidden_states_ = torch.zeros(
            self.max_num_token_, self.hidden_size_, dtype=DTYPE, device=self.device)
        self.captureDecode()

    def prepareCaptureInputs(self, inputs, batch_size, seq_len_or_tokens):
        cap = self.capture_mem_hold_.py_model_inputs_
        a, ca = inputs.attention_inputs, cap.attention_inputs
        a.is_prefill = self.is_prefill_cuda_graph_mode_ or self.num_tokens_per_bs_ > 1
        inputs.input_ids = cap.input_ids[:seq_len_or_tokens]
        a.input_lengths = ca.input_lengths[:batch_size]
        a.sequence_lengths = ca.sequence_lengths[:batch_size]
        a.kv_cache_block_id_device = ca.kv_cache_block_id_device[:batch_size]
        a.kv_cache_block_id_host = ca.kv_cache_block_id_host[:batch_size]
        a.sequence_lengths_plus_1_d = ca.sequence_lengths_plus_1_d[:batch_size]

    def createCaptureMemoryHold(self, inputs, tokens_count):
        return CaptureMemoryHold(self.capture_mem_hold_.decoder_layer_hidden_states_[:tokens_count], inputs)

    def captureOneGraphInstance(self, key, key_type):
        inst = self.graph_instances_[key]
        inputs = inst.mem_hold_.py_model_inputs_
        a = inputs.attention_inputs

        def step():
            outputs = self.py_forward_method_(inputs)
            inst.mem_hold_.decoder_layer_hidden_states_.copy_(outputs.hidden_states)
            return inst.mem_hold_.decoder_layer_hidden_states_

        inst.graph_, _ = capture(step, device=self.device, warmups=2, name=f"decode graph {key_type} {key}",
                                 owner="CudaGraphRunner",
                                 static={"input_ids": inputs.input_ids,
                                         "sequence_lengths_plus_1_d": a.sequence_lengths_plus_1_d,
                                         "kv_cache_block_id_device": a.kv_cache_block_id_device},
                                 state={"k_cache": self.kv_cache[0], "v_cache": self.kv_cache[1]})

    def replayAndSyncCheck(self, key, key_type):
        self.graph_instances_[key].graph_.replay()

    def captureDecode(self):
        for bs in self.capture_range_:
            self.graph_instances_.setdefault(bs, GraphInstance())
        for bs in reversed(self.capture_range_):
            inputs = PyModelInputs()
            self.prepareCaptureInputs(inputs, bs, bs * self.num_tokens_per_bs_)
            self.graph_instances_[bs].mem_hold_ = self.createCaptureMemoryHold(inputs, bs * self.num_tokens_per_bs_)
            self.captureOneGraphInstance(bs, "batch size")
            self.replayAndSyncCheck(bs, "batch size")

    # -- replay -------------------------------------------------------------------------------------------------------

    def tryGetRealGraphDecodeBatchSize(self, inputs, state):
        state.current_batch_size = inputs.attention_inputs.input_lengths.shape[0]
        fits = [bs for bs in self.capture_range_ if bs >= state.current_batch_size]
        if not fits:
            return False
        state.current_real_graph_bs = fits[0]
        state.seq_len_sum = state.current_batch_size
        return True

    def canRun(self, inputs, state):
        if not self.enable_cuda_graph_ or (inputs.attention_inputs.is_prefill and not self.is_prefill_cuda_graph_mode_):
            return False
        return self.tryGetRealGraphDecodeBatchSize(inputs, state)

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

    def prepareInputs(self, inputs, state):
        py_model_inputs_ = self.graph_instances_[state.current_real_graph_bs].mem_hold_.py_model_inputs_
        a, ca = inputs.attention_inputs, py_model_inputs_.attention_inputs
        n = state.current_batch_size
        # clear kv_cache_block_id_device, otherwise it will cause the cache block pollution
        ca.kv_cache_block_id_device.fill_(0)
        py_model_inputs_.input_ids[:inputs.input_ids.shape[0]].copy_(inputs.input_ids)
        ca.sequence_lengths[:n].copy_(a.sequence_lengths)
        self.copySmallerIntoLarger(a.kv_cache_block_id_device, ca.kv_cache_block_id_device)
        self.copySmallerIntoLarger(a.kv_cache_block_id_host, ca.kv_cache_block_id_host)
        ca.sequence_lengths_plus_1_d[:n].copy_(a.sequence_lengths_plus_1_d)
        ca.input_lengths[:n].copy_(a.input_lengths)

    def forward(self, inputs, state):
        self.prepareInputs(inputs, state)
        inst = self.graph_instances_[state.current_real_graph_bs]
        out = replay(inst.graph_, inst.mem_hold_.decoder_layer_hidden_states_, real=state.seq_len_sum,
                     size=state.current_real_graph_bs * self.num_tokens_per_bs_)
        return PyModelOutputs(out[:state.seq_len_sum])


# --- rtp_llm/cpp/models/PyWrappedModel (reduced) ----------------------------------------------------------------------

class GptModelInputs:
    def __init__(self, combo_tokens, input_lengths, sequence_lengths, kv_cache_block_id, is_prefill):
        self.combo_tokens = combo_tokens
        self.input_lengths = input_lengths
        self.sequence_lengths = sequence_lengths
        self.kv_cache_block_id = kv_cache_block_id         # [group, bs, kernel blocks] host
        self.is_prefill = is_prefill


class PyWrappedModel:
    def __init__(self, device, enable_cuda_graph):
        self.device = device
        self.py_model_ = GptModel(device)
        self.enable_cuda_graph_ = enable_cuda_graph
        self.graph_runner_ = None
        if enable_cuda_graph:
            graph_params = {"max_bs": MAX_BS, "num_tokens_per_bs": NUM_TOKENS_PER_BS, "max_seq_len": MAX_SEQ_LEN,
                            "tokens_per_block": TOKENS_PER_BLOCK, "sp_steps": SP_STEPS,
                            "decode_capture_batch_sizes": DECODE_CAPTURE_BATCH_SIZES,
                            "kv_cache": (self.py_model_.k_cache, self.py_model_.v_cache)}
            if _variant == "fix":
                graph_params["kernel_tokens_per_block"] = KERNEL_TOKENS_PER_BLOCK
            self.graph_runner_ = CudaGraphRunner(graph_params, self.py_model_.forward, device)
            self.graph_runner_.initCapture()

    def setupKVCacheForAttentionInputs(self, py_attn_inputs, inputs):
        group_view = inputs.kv_cache_block_id[0]
        py_attn_inputs.kv_cache_block_id_host = group_view
        py_attn_inputs.kv_cache_block_id_device = group_view.to(self.device)

    def forward(self, inputs):
        attention_inputs = PyAttentionInputs()
        attention_inputs.is_prefill = inputs.is_prefill
        attention_inputs.input_lengths = inputs.input_lengths
        attention_inputs.sequence_lengths = inputs.sequence_lengths
        attention_inputs.sequence_lengths_plus_1_d = (inputs.sequence_lengths + 1).to(self.device)
        self.setupKVCacheForAttentionInputs(attention_inputs, inputs)
        py_model_inputs = PyModelInputs(inputs.combo_tokens.to(self.device), attention_inputs)
        graph_state = CudaGraphState()
        if self.enable_cuda_graph_ and self.graph_runner_.canRun(py_model_inputs, graph_state):
            py_model_outputs = self.graph_runner_.forward(py_model_inputs, graph_state)
        else:
            py_model_outputs = self.py_model_.forward(py_model_inputs)
        return py_model_outputs.hidden_states.clone()


# --- scheduler / stream side (reduced) --------------------------------------------------------------------------------

class Stream:
    def __init__(self, tokens, blocks):
        self.tokens = list(tokens)
        self.blocks = list(blocks)
        self.block_ids = BlockIds(TOKENS_PER_BLOCK // KERNEL_TOKENS_PER_BLOCK)
        self.in_cache = 0

    def reserve(self, length):
        needed = -(-length // TOKENS_PER_BLOCK)
        if needed > len(self.block_ids.block_indices):
            self.block_ids.add(self.blocks[len(self.block_ids.block_indices):needed])


def _batch(streams, is_prefill):
    for s in streams:
        s.reserve(len(s.tokens) if is_prefill else s.in_cache + 1)
    width = max(len(s.block_ids.kernelBlocks()) for s in streams)
    table = torch.zeros(1, len(streams), width, dtype=INT)
    for b, s in enumerate(streams):
        kernel_blocks = s.block_ids.kernelBlocks()
        table[0, b, :len(kernel_blocks)] = torch.tensor(kernel_blocks, dtype=INT)
    if is_prefill:
        tokens = [t for s in streams for t in s.tokens]
        input_lengths = [len(s.tokens) for s in streams]
    else:
        tokens = [s.tokens[-1] for s in streams]
        input_lengths = [1] * len(streams)
    return GptModelInputs(torch.tensor(tokens, dtype=INT), torch.tensor(input_lengths, dtype=INT),
                          torch.tensor([s.in_cache for s in streams], dtype=INT), table, is_prefill)


def _serve(device, enable_cuda_graph):
    model = PyWrappedModel(device, enable_cuda_graph)
    streams = [Stream([3, 9, 4], blocks=[1, 3, 5]), Stream([7, 12], blocks=[2, 4, 6])]
    outs = []
    for step in range(6):
        is_prefill = step == 0
        inputs = _batch(streams, is_prefill)
        hidden = model.forward(inputs)
        outs.append(hidden)
        last = torch.cumsum(inputs.input_lengths, 0) - 1
        next_tokens = torch.argmax(hidden[last.to(hidden.device)] @ model.py_model_.embedding.T, dim=-1).tolist()
        for s, n, tok in zip(streams, inputs.input_lengths.tolist(), next_tokens):
            s.in_cache += n
            s.tokens.append(int(tok))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
