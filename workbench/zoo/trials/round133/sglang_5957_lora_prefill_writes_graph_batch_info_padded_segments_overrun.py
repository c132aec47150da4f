"""SGLang multi-LoRA serving with the Triton LoRA backend under CUDA graphs: ``LoRAManager.prepare_lora_batch`` wrote
the per-batch segment metadata (``seg_lens``, ``seg_indptr``, ``weight_indices``) into the one preallocated
``cuda_graph_batch_info`` whenever the batch had at most ``max_bs_in_cuda_graph`` requests, prefill (extend) batches
included. A decode graph replayed at a padded batch size reads the segment rows past the live batch, which the decode
step never writes: after a prefill with more requests than the next decode batch, those rows hold the prefill's prompt
lengths, and the captured segment-GEMM kernels walk that many rows from the padded segment's start, past the graph's
activations (an illegal memory access on the GPU; an out-of-range index here). The fix keeps prefill batches out of
the graph buffer (only ``forward_mode.is_cuda_graph()`` batches use it, with ``seg_lens`` filled with 1).

Upstream: https://github.com/sgl-project/sglang/pull/5957 ("Fix flaky issues of lora and add multi batch tests",
sgl-project/sglang, by Qiaolin Yu, PR description dated 2025-05-01, merged; commit
3042f1da61a00b35e0a910f1629a218357dbff4a on main, dated 2025-05-04, read in a stored mirror of the history, the fork
zcnrex/sglang). Read: the full diff of 3042f1da6 (``lora_manager.py``: the graph-buffer branch of
``prepare_lora_batch`` now also requires ``forward_batch.forward_mode.is_cuda_graph()`` and always does
``seg_lens[:bs].fill_(1)``, dropping the ``extend_seq_lens`` copy; the eager branch's ``lora_ranks`` / ``scalings``
become ``torch.zeros`` instead of ``torch.empty``; the rest is tests: ``test_lora.py``'s five batches of three prompts
mixing two adapters and ``None``, ``utils.py``'s model cases, ``test_multi_lora_backend.py`` trimmed). At the parent
(2b63798c7): ``python/sglang/srt/lora/lora_manager.py`` (``init_cuda_graph_batch_info``, ``prepare_lora_batch``,
``convert_to_lora_layers``), ``lora/utils.py`` (``LoRABatchInfo``), ``lora/mem_pool.py`` (``LoRAMemoryPool``: buffer
shapes, ``prepare_lora_batch`` slot assignment, ``load_lora_weight_to_buffer``, ``get_tensor``, ``get_buffer_id``),
``lora/layers.py`` (``ColumnParallelLinearWithLoRA`` and ``RowParallelLinearWithLoRA``: ``set_lora_info``,
``apply_lora``, ``forward``), ``lora/backend/base_backend.py`` and ``triton_backend.py`` (``run_lora_a_sgemm``,
``run_lora_b_sgemm``, ``fuse_output_add``), ``lora/triton_ops/sgemm_lora_a.py`` and ``sgemm_lora_b.py`` (kernels and
launchers: grid ``(cdiv(max_len, BLOCK_S) * cdiv(N, BLOCK_N), bs)``, ``BLOCK_S = 16``, row masks ``s_offset <
seg_len`` from ``seg_indptr[batch_id]``), the first lines of ``qkv_lora_b.py``;
``model_executor/cuda_graph_runner.py`` (``get_batch_sizes_to_capture``, ``CudaGraphRunner.__init__`` calling
``init_cuda_graph_batch_info(self.max_bs)``, ``can_run``, ``capture`` largest first, ``capture_one_batch_size`` with
``lora_paths = [first adapter] * bs`` and ``prepare_lora_batch`` before two warmups, ``replay_prepare`` padding with
``bisect_left``, ``replay`` slicing to ``raw_num_token``); ``forward_batch_info.py`` (``ForwardMode.is_cuda_graph``,
``ForwardBatch.init_new`` calling ``prepare_lora_batch`` for every batch); ``model_runner.py`` (``forward``,
``forward_decode``, ``forward_extend``); ``test/runners.py`` (``SRTRunner`` sets ``cuda_graph_max_bs=4``;
``batch_forward`` sends all prompts in one ``generate``).
Not read: the PR's review thread and any issue it fixed (none is linked); the scheduler (how requests are batched and
when a request finishes), the overlap worker thread, ``gate_up_lora_b.py`` and most of ``qkv_lora_b.py``, the
flashinfer LoRA backend, the attention backends, CI logs.
Symptom: the PR says only: "Currently, lora will produce flaky issues (Triton kernel invalid memory access in the
prefill stage) after running multiple batches", and "Make the lora manager not use the preallocated batch_info buffer
in the prefill stage." It gives no trace. Which read faulted is my reading, not upstream's: the prefill kernels read
only rows the prefill wrote, so the access that can run off is a padded decode replay's, after a prefill; CUDA
reports a fault at the next synchronisation, and the next one after a decode step can be the following prefill's
``int(torch.max(seg_lens))`` in ``prepare_lora_batch``. The PR's own test (three prompts, graphs up to 4) does not meet
this trigger as I read the code; what it did meet was not found.
Mechanism: ``CudaGraphRunner`` captures decode graphs for ``[1, 2, 4]`` (the test runner's ``cuda_graph_max_bs=4``),
largest first, each after ``prepare_lora_batch`` filled ``seg_lens[:bs]`` with 1 and ``seg_indptr`` with ``0..bs``;
the Triton launchers freeze ``batch_info.bs`` (grid axis 1) and ``batch_info.max_len`` (1) into the graph, and each
program reads its segment's start, length and adapter from the graph buffer. Before the fix, a prefill of ``bs_p <=
4`` requests takes the same branch: ``seg_lens[:bs_p]`` becomes the prompt lengths and ``seg_indptr[1 : bs_p + 1]``
their prefix sums (the eager kernels are right: they read only those rows). A decode step writes ``seg_lens[:raw_bs]``
and ``seg_indptr[1 : raw_bs + 1]`` only; replayed at the padded size, its padded segment ``j`` starts at
``seg_indptr[j]`` and covers ``seg_lens[j]`` rows (up to ``BLOCK_S`` per frozen row block). When the decode batch is
smaller than the prefill that preceded it (a request of the prefill finished at its first token), ``seg_lens[j]`` is
a prompt length and the segment runs past the graph's ``bs`` rows of activations. With ``--disable-cuda-graph``,
batches allocate fresh metadata and never pad; a decode batch of a captured size reads no padded row.
Doctor: stale-padding, at prepare_lora_batch. The rows the replay reads past the live batch (the padded rows of
``seg_lens`` / ``weight_indices``) hold what an eager prefill left in the graph's buffer, and the step's outcome depends
on them; ``prepare_lora_batch`` is where the prefill decides to write into that buffer, and the only function the fix
changes.
Fix (upstream): use ``cuda_graph_batch_info`` only when ``forward_batch.forward_mode.is_cuda_graph()`` (decode), always
``seg_lens[:bs].fill_(1)``; prefill batches get fresh tensors, whose ``lora_ranks`` / ``scalings`` are now zeroed (that
second change does not touch the graphs; modelled as in the diff).
Modelled: ``LoRABatchInfo``, ``LoRAManager`` (``init_cuda_graph_batch_info``, ``prepare_lora_batch`` as at the parent,
bug/fix as in the diff, ``convert_to_lora_layers``), ``LoRAMemoryPool`` (buffers ``(max_loras, r, in)`` /
``(1, max_loras, out, r)``, slot assignment, ``load_lora_weight_to_buffer``, ``get_tensor``, ``get_buffer_id``),
``TritonLoRABackend`` (``set_batch_info``, ``run_lora_a_sgemm``, ``run_lora_b_sgemm``, ``fuse_output_add``),
``sgemm_lora_a_fwd`` / ``sgemm_lora_b_fwd`` (launch parameters as upstream), ``ColumnParallelLinearWithLoRA`` /
``RowParallelLinearWithLoRA`` (``set_lora_info``, ``apply_lora``, ``forward``), ``ForwardMode``,
``ForwardBatch.init_new``, ``get_batch_sizes_to_capture``, ``CudaGraphRunner`` (``__init__``, ``can_run``, ``capture``,
``capture_one_batch_size`` with two warmups, ``replay_prepare``, ``replay``), ``ModelRunner`` (``forward``,
``forward_decode``, ``forward_extend``).
Stand-ins: torch code for the two Triton kernels, vectorised over the grid's segments (a masked lane touches no
memory; an unmasked lane past the tensor raises, where the GPU faults; masked stores go through a scratch row, and the
fused add through ``index_add_``); matrix products as a product and a row sum (``rowdot``), so a row's value does
not depend on the batch it is computed in; a two-layer MLP-only model (embedding, ``up_proj`` / ``down_proj`` with LoRA,
residual, ``lm_head``) in float64: no attention, no KV cache, no positions, tp = 1; a plain linear ``quant_method``; the
scheduler reduced to a fixed list of steps with greedy sampling; two adapters (ranks 4 and 2), no ``None`` requests,
``max_loras_per_batch = 2``. Announced: the runner's ``input_ids`` and the five ``cuda_graph_batch_info`` tensors as
static inputs of every graph; as padded rows only ``input_ids``' (the runner pads its own buffer; it never touches the
LoRA metadata, whose padded rows nobody knows about upstream).
Workload: requests r0 (sql, 3 prompt tokens, 5 new), r1 (chat, 5, 1 new), r2 (sql, 2, 3 new), r3 (chat, 4, 3 new),
later r4 (sql, 6, 2 new). Steps: prefill r0-r3 (4 requests, eager; r1 is done), decode r0 r2 r3 twice (3 requests, the
bs-4 graph), prefill r4, decode r0 r4 (bs 2), decode r0 (bs 1). Output per step: the logits of the live rows.
Measured: bug: misbehaves, raised IndexError at the first decode replay ("index 4 is out of bounds for dimension 0
with size 4", from ``x[safe_rows]`` in ``sgemm_lora_a_fwd``: padded segment 3 starts at row 3 and keeps r3's prompt
length, 4); fix: equals eager (max |graph - eager| = 0).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/5957"
FAMILY = "stale padded metadata"
KIND = "stale-padding"
SITE = "prepare_lora_batch"
SYMPTOM = ("multi-LoRA with CUDA graphs: after a prefill batch larger than the next decode batch, the padded decode "
           "replay reads the prefill's segment lengths from the shared graph batch info and the LoRA kernels run past "
           "the graph's rows (a Triton invalid memory access)")

CUDA_GRAPH_BS = [1, 2, 4]          # SRTRunner's cuda_graph_max_bs=4
VOCAB, HIDDEN, INTER, NUM_LAYERS = 16, 16, 32, 2
ADAPTERS = {"sql": (4, 8.0), "chat": (2, 4.0)}     # name -> (r, lora_alpha)
MAX_LORAS_PER_BATCH = 2
BLOCK_S = 16
DTYPE = torch.float64

_variant = "bug"


def cdiv(a, b):
    return -(-a // b)


def rowdot(a, b):
    """``a @ b.T`` over the last dim, batched: a product and a sum per output, so that a row's value does not depend
    on how many rows share the call (a padded replay and the eager step then agree to the last bit)."""
    return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)


# --- sglang/srt/lora/utils.py, lora.py (reduced) ----------------------------------------------------------------------

@dataclasses.dataclass
class LoRABatchInfo:
    bs: int
    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    max_len: int
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor


class LoRAAdapter:
    def __init__(self, name, r, alpha, device, gen):
        self.name, self.hf_config, self.scaling = name, {"r": r}, alpha / r
        self.layers = [{"up_proj.lora_A": randn(r, HIDDEN, gen=gen, device=device, scale=0.5).to(DTYPE),
                        "up_proj.lora_B": randn(INTER, r, gen=gen, device=device, scale=0.5).to(DTYPE),
                        "down_proj.lora_A": randn(r, INTER, gen=gen, device=device, scale=0.5).to(DTYPE),
                        "down_proj.lora_B": randn(HIDDEN, r, gen=gen, device=device, scale=0.5).to(DTYPE)}
                       for _ in range(NUM_LAYERS)]


# --- sglang/srt/lora/triton_ops/sgemm_lora_{a,b}.py (torch stand-ins for the Triton kernels) --------------------------

def _segment_lanes(batch_info: LoRABatchInfo, S: int, device):
    """Grid axis 1 = ``batch_info.bs`` segments, axis 0's row blocks = ``cdiv(max_len, BLOCK_S)``: each segment's
    program loads ``seg_len``, ``seg_start`` and ``w_index`` and covers rows ``seg_start + s`` with ``s < seg_len``."""
    bs = batch_info.bs
    s_offset = torch.arange(cdiv(batch_info.max_len, BLOCK_S) * BLOCK_S, device=device)
    seg_len = batch_info.seg_lens[:bs]
    seg_start = batch_info.seg_indptr[:bs].long()
    w_index = batch_info.weight_indices[:bs].long()
    rows = seg_start[:, None] + s_offset[None, :]
    row_mask = s_offset[None, :] < seg_len[:, None]
    safe_rows = torch.where(row_mask, rows, 0)          # a masked lane touches no memory
    scratch = torch.where(row_mask, rows, S)            # masked stores go to a scratch row
    return w_index, row_mask, safe_rows, scratch


def sgemm_lora_a_fwd(x, weights, batch_info: LoRABatchInfo, stack_num: int = 1):
    S, R = x.shape[0], weights.shape[-2]
    w_index, row_mask, safe_rows, scratch = _segment_lanes(batch_info, S, x.device)
    rank = batch_info.lora_ranks[w_index].long()
    N = torch.clamp(rank * stack_num, max=R)                          # N = tl.minimum(N, rank * stack_num)
    x_tile = torch.where(row_mask[..., None], x[safe_rows], 0.0)       # an unmasked row past S: the GPU faults
    n_mask = torch.arange(R, device=x.device)[None, :] < N[:, None]
    w = torch.where(n_mask[..., None], weights[w_index], 0.0)
    partial = rowdot(x_tile, w)
    output = torch.empty((S + 1, R), device=x.device, dtype=x.dtype)  # upstream: torch.empty((S, R))
    output.index_copy_(0, scratch.flatten(), partial.flatten(0, 1))
    return output[:S]


def sgemm_lora_b_fwd(x, weights, batch_info: LoRABatchInfo, base_output=None):
    S, N, R = x.shape[0], weights.shape[-2], weights.shape[-1]
    w_index, row_mask, safe_rows, scratch = _segment_lanes(batch_info, S, x.device)
    K = torch.clamp(batch_info.lora_ranks[w_index].long(), max=R)    # K = tl.minimum(K, rank)
    scaling = batch_info.scalings[w_index].to(x.dtype)
    k_mask = torch.arange(R, device=x.device)[None, :] < K[:, None]
    x_tile = torch.where(row_mask[..., None] & k_mask[:, None, :], x[safe_rows], 0.0)
    w = torch.where(k_mask[:, None, :], weights[w_index], 0.0)
    partial = rowdot(x_tile, w) * scaling[:, None, None]
    if base_output is None:
        output = torch.empty((S + 1, N), device=x.device, dtype=x.dtype)
        output.index_copy_(0, scratch.flatten(), partial.flatten(0, 1))
        return output[:S]
    # fuse_scaling_add: output rows += partial where the lane is live
    delta = torch.zeros((S + 1, N), device=x.device, dtype=x.dtype)
    delta.index_add_(0, scratch.flatten(), torch.where(row_mask[..., None], partial, 0.0).flatten(0, 1))
    base_output.add_(delta[:S])
    return base_output


# --- sglang/srt/lora/backend/triton_backend.py, layers.py, mem_pool.py (reduced) --------------------------------------

class TritonLoRABackend:
    def __init__(self, name="triton"):
        self.name, self.batch_info, self.fuse_output_add = name, None, True

    def set_batch_info(self, batch_info):
        self.batch_info = batch_info

    def run_lora_a_sgemm(self, x, weights, *args, **kwargs):
        return sgemm_lora_a_fwd(x, weights, self.batch_info)

    def run_lora_b_sgemm(self, x, weights, base_output=None, *args, **kwargs):
        return sgemm_lora_b_fwd(x, weights, self.batch_info, base_output)


class LinearBase(torch.nn.Module):
    def __init__(self, in_dim, out_dim, gen, device):
        super().__init__()
        self.weight = randn(out_dim, in_dim, gen=gen, device=device, scale=in_dim ** -0.5).to(DTYPE)

    def forward(self, x):
        return rowdot(x, self.weight), None


class ColumnParallelLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class ColumnParallelLinearWithLoRA(torch.nn.Module):
    def __init__(self, base_layer, lora_backend):
        super().__init__()
        self.base_layer, self.lora_backend, self.set_lora = base_layer, lora_backend, False

    def set_lora_info(self, A_buffer, B_buffer):
        self.set_lora, self.A_buffer, self.B_buffer = True, A_buffer, B_buffer

    def apply_lora(self, base_output, x):
        lora_a_output = self.lora_backend.run_lora_a_sgemm(x, self.A_buffer)
        lora_output = self.lora_backend.run_lora_b_sgemm(lora_a_output, self.B_buffer[0], base_output=base_output)
        return lora_output if self.lora_backend.fuse_output_add else base_output + lora_output

    def forward(self, input_):
        output_parallel, _ = self.base_layer(input_)
        if self.set_lora:
            output_parallel = self.apply_lora(output_parallel, input_)
        return output_parallel, None


class RowParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    pass


class LoRAMemoryPool:
    def __init__(self, max_loras_per_batch, max_lora_dim, device):
        self.max_loras_per_batch = max_loras_per_batch
        dims = {"up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
        self.A_buffer = {n: [torch.empty(max_loras_per_batch, max_lora_dim, i, dtype=DTYPE, device=device)
                             for _ in range(NUM_LAYERS)] for n, (i, o) in dims.items()}
        self.B_buffer = {n: [torch.empty(1, max_loras_per_batch, o, max_lora_dim, dtype=DTYPE, device=device)
                             for _ in range(NUM_LAYERS)] for n, (i, o) in dims.items()}
        self.uid_to_buffer_id, self.buffer_id_to_uid = {}, [""] * max_loras_per_batch

    def prepare_lora_batch(self, cur_uids, lora_adapters):
        def get_available_buffer_slot():
            for buffer_id in range(self.max_loras_per_batch):
                if self.buffer_id_to_uid[buffer_id] == "":
                    return buffer_id, ""
            for buffer_id in range(self.max_loras_per_batch):
                if self.buffer_id_to_uid[buffer_id] not in cur_uids:
                    return buffer_id, self.buffer_id_to_uid[buffer_id]
            raise ValueError("No available buffer slots found.")

        for uid in sorted(cur_uids):
            if uid not in self.uid_to_buffer_id:
                buffer_id, evicted = get_available_buffer_slot()
                if evicted != "":
                    self.uid_to_buffer_id.pop(evicted)
                self.load_lora_weight_to_buffer(uid, buffer_id, lora_adapters[uid])
                self.uid_to_buffer_id[uid], self.buffer_id_to_uid[buffer_id] = buffer_id, uid

    def load_lora_weight_to_buffer(self, uid, buffer_id, lora_adapter):
        lora_rank = lora_adapter.hf_config["r"]
        for layer_id, weights in enumerate(lora_adapter.layers):
            for name in ("up_proj", "down_proj"):
                self.A_buffer[name][layer_id][buffer_id][:lora_rank, :].copy_(weights[f"{name}.lora_A"])
                self.B_buffer[name][layer_id][0][buffer_id][:, :lora_rank].copy_(weights[f"{name}.lora_B"])

    def get_tensor(self, weight_name, layer_id, lora_type):
        return (self.A_buffer if lora_type == "A" else self.B_buffer)[weight_name][layer_id]

    def get_buffer_id(self, lora_uid):
        return self.uid_to_buffer_id[lora_uid]


# --- sglang/srt/lora/lora_manager.py (reduced) ------------------------------------------------------------------------

class LoRAManager:
    def __init__(self, base_model, lora_adapters, max_loras_per_batch, device):
        self.base_model, self.loras, self.device = base_model, lora_adapters, device
        self.max_loras_per_batch = max_loras_per_batch
        self.lora_backend = TritonLoRABackend("triton")
        self.max_lora_dim = max(a.hf_config["r"] for a in lora_adapters.values())
        self.convert_to_lora_layers()
        self.memory_pool = LoRAMemoryPool(max_loras_per_batch, self.max_lora_dim, device)

    def init_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int):
        self.max_bs_in_cuda_graph = max_bs_in_cuda_graph
        i32 = dict(dtype=torch.int32, device=self.device)
        self.cuda_graph_batch_info = LoRABatchInfo(
            bs=self.max_bs_in_cuda_graph,
            seg_lens=torch.zeros(self.max_bs_in_cuda_graph, **i32),
            seg_indptr=torch.zeros(self.max_bs_in_cuda_graph + 1, **i32),
            max_len=0,
            weight_indices=torch.zeros(self.max_bs_in_cuda_graph, **i32),
            lora_ranks=torch.zeros(self.max_loras_per_batch, **i32),
            scalings=torch.zeros(self.max_loras_per_batch, dtype=DTYPE, device=self.device))

    def convert_to_lora_layers(self):
        self.lora_modules = {}
        for layer_id, layer in enumerate(self.base_model.model.layers):
            layer.mlp.up_proj = ColumnParallelLinearWithLoRA(layer.mlp.up_proj, self.lora_backend)
            layer.mlp.down_proj = RowParallelLinearWithLoRA(layer.mlp.down_proj, self.lora_backend)
            self.lora_modules[layer_id] = [("up_proj", layer.mlp.up_proj), ("down_proj", layer.mlp.down_proj)]

    def prepare_lora_batch(self, forward_batch):
        cur_uids = set(forward_batch.lora_paths)
        assert len(cur_uids) <= self.max_loras_per_batch
        self.memory_pool.prepare_lora_batch(cur_uids, self.loras)

        bs = forward_batch.batch_size
        if _variant == "fix":
            use_graph_buffer = (hasattr(self, "max_bs_in_cuda_graph") and bs <= self.max_bs_in_cuda_graph
                                and forward_batch.forward_mode.is_cuda_graph())
        else:
            # Do in-place updates when CUDA graph is enabled. Note that if CUDA graph is enabled, the batch whose
            # bs <= max_bs_in_cuda_graph will also use these preallocated buffers, no matter whether the batch can
            # use CUDA graph or not.
            use_graph_buffer = hasattr(self, "max_bs_in_cuda_graph") and bs <= self.max_bs_in_cuda_graph
        if use_graph_buffer:
            info = self.cuda_graph_batch_info
            info.bs = bs
            if _variant == "bug" and forward_batch.forward_mode.is_extend():
                info.seg_lens[:bs].copy_(forward_batch.extend_seq_lens)
            else:
                info.seg_lens[:bs].fill_(1)
            torch.cumsum(info.seg_lens[:bs], dim=0, out=info.seg_indptr[1: bs + 1])
            info.max_len = int(torch.max(info.seg_lens[:bs]))
            for i, lora_path in enumerate(forward_batch.lora_paths):
                info.weight_indices[i] = self.memory_pool.get_buffer_id(lora_path)
                lora = self.loras[lora_path]
                info.lora_ranks[info.weight_indices[i]] = lora.hf_config["r"]
                info.scalings[info.weight_indices[i]] = lora.scaling
            batch_info = info
        else:
            seg_lens = (forward_batch.extend_seq_lens if forward_batch.forward_mode.is_extend()
                        else torch.ones(bs, device=self.device))
            seg_indptr = torch.zeros((bs + 1,), dtype=torch.int32, device=self.device)
            seg_indptr[1:] = torch.cumsum(seg_lens, dim=0)
            max_len = int(torch.max(seg_lens))
            weight_indices = torch.empty((bs,), dtype=torch.int64, device=self.device)
            alloc = torch.zeros if _variant == "fix" else torch.empty
            lora_ranks = alloc((self.max_loras_per_batch,), dtype=torch.int64, device=self.device)
            scalings = alloc((self.max_loras_per_batch,), dtype=DTYPE, device=self.device)
            for i, lora_path in enumerate(forward_batch.lora_paths):
                weight_indices[i] = self.memory_pool.get_buffer_id(lora_path)
                lora = self.loras[lora_path]
                lora_ranks[weight_indices[i]] = lora.hf_config["r"]
                scalings[weight_indices[i]] = lora.scaling
            batch_info = LoRABatchInfo(bs, seg_lens, seg_indptr, max_len, weight_indices, lora_ranks, scalings)
        self.lora_backend.set_batch_info(batch_info)

        for layer_id, modules in self.lora_modules.items():
            for module_name, module in modules:
                module.set_lora_info(self.memory_pool.get_tensor(module_name, layer_id, "A"),
                                     self.memory_pool.get_tensor(module_name, layer_id, "B"))


# --- sglang/srt/model_executor/forward_batch_info.py, models/llama.py (reduced) ---------------------------------------

class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()

    def is_extend(self):
        return self == ForwardMode.EXTEND

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_cuda_graph(self):
        return self == ForwardMode.DECODE


@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    lora_paths: list
    extend_seq_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None

    @classmethod
    def init_new(cls, mode, input_ids, lora_paths, extend_seq_lens, model_runner):
        device = model_runner.device
        ret = cls(mode, len(lora_paths), torch.tensor(input_ids, dtype=torch.int64).to(device), list(lora_paths))
        if mode.is_extend():
            ret.extend_seq_lens = torch.tensor(extend_seq_lens, dtype=torch.int32).to(device)
            ret.extend_start_loc = torch.cumsum(ret.extend_seq_lens, dim=0) - ret.extend_seq_lens
        if model_runner.lora_manager is not None:
            model_runner.lora_manager.prepare_lora_batch(ret)
        return ret


class LlamaMLP(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.up_proj = ColumnParallelLinear(HIDDEN, INTER, gen, device)
        self.down_proj = RowParallelLinear(INTER, HIDDEN, gen, device)

    def forward(self, x):
        h, _ = self.up_proj(x)
        out, _ = self.down_proj(torch.nn.functional.silu(h))
        return out


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.mlp = LlamaMLP(gen, device)

    def forward(self, hidden_states):
        return hidden_states + self.mlp(hidden_states)


class LlamaModel(torch.nn.Module):
    def __init__(self, gen, device):
        super().__init__()
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(gen, device) for _ in range(NUM_LAYERS)])

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = generator(11)
        self.model = LlamaModel(gen, device)
        self.lm_head = randn(VOCAB, HIDDEN, gen=gen, device=device, scale=HIDDEN ** -0.5).to(DTYPE)

    def forward(self, input_ids, forward_batch):
        hidden_states = self.model(input_ids)
        if forward_batch.forward_mode.is_extend():        # LogitsProcessor: last token of each sequence
            hidden_states = hidden_states[forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1]
        return rowdot(hidden_states, self.lm_head)


# --- sglang/srt/model_executor/cuda_graph_runner.py, model_runner.py (reduced) ----------------------------------------

def get_batch_sizes_to_capture(model_runner):
    return [bs for bs in CUDA_GRAPH_BS if bs <= model_runner.cuda_graph_max_bs]


class CudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.graphs, self.output_buffers = {}, {}
        self.capture_bs = get_batch_sizes_to_capture(model_runner)
        self.capture_forward_mode = ForwardMode.DECODE
        self.max_bs = max(self.capture_bs)
        self.model_runner.lora_manager.init_cuda_graph_batch_info(self.max_bs)
        self.input_ids = torch.zeros((self.max_bs,), dtype=torch.int64, device=model_runner.device)
        self.capture()

    def can_run(self, forward_batch):
        return forward_batch.batch_size <= self.max_bs

    def capture(self):
        for bs in reversed(self.capture_bs):
            self.graphs[bs], self.output_buffers[bs] = self.capture_one_batch_size(bs)

    def capture_one_batch_size(self, bs):
        input_ids = self.input_ids[:bs]
        lora_paths = [next(iter(self.model_runner.lora_adapters))] * bs
        forward_batch = ForwardBatch(self.capture_forward_mode, bs, input_ids, lora_paths)
        lora_manager = self.model_runner.lora_manager
        lora_manager.prepare_lora_batch(forward_batch)

        def run_once():
            return self.model_runner.model.forward(input_ids, forward_batch)

        info = lora_manager.cuda_graph_batch_info
        return capture(run_once, device=self.model_runner.device, warmups=2, name=f"decode bs={bs}",
                       static={"input_ids": self.input_ids, "seg_lens": info.seg_lens, "seg_indptr": info.seg_indptr,
                               "weight_indices": info.weight_indices, "lora_ranks": info.lora_ranks,
                               "scalings": info.scalings},
                       owner="CudaGraphRunner")

    def replay_prepare(self, forward_batch):
        raw_bs = forward_batch.batch_size
        index = bisect.bisect_left(self.capture_bs, raw_bs)
        self.bs, self.raw_bs = self.capture_bs[index], raw_bs
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)

    def replay(self, forward_batch):
        self.replay_prepare(forward_batch)
        logits = replay(self.graphs[self.bs], self.output_buffers[self.bs], real=self.raw_bs, size=self.bs,
                        padded={"input_ids": self.input_ids})
        return logits[: self.raw_bs]


class ModelRunner:
    def __init__(self, device, disable_cuda_graph):
        self.device, self.cuda_graph_max_bs = device, 4
        self.model = LlamaForCausalLM(device)
        gen = generator(5)
        self.lora_adapters = {name: LoRAAdapter(name, r, alpha, device, gen) for name, (r, alpha) in ADAPTERS.items()}
        self.lora_manager = LoRAManager(self.model, self.lora_adapters, MAX_LORAS_PER_BATCH, device)
        self.cuda_graph_runner = None if disable_cuda_graph else CudaGraphRunner(self)

    def forward_decode(self, forward_batch):
        return self.model.forward(forward_batch.input_ids, forward_batch)

    def forward_extend(self, forward_batch):
        return self.model.forward(forward_batch.input_ids, forward_batch)

    def forward(self, forward_batch):
        if (forward_batch.forward_mode.is_cuda_graph() and self.cuda_graph_runner
                and self.cuda_graph_runner.can_run(forward_batch)):
            return self.cuda_graph_runner.replay(forward_batch)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(forward_batch)
        return self.forward_extend(forward_batch)


# --- the workload: a fixed schedule of prefill and decode steps, greedy sampling --------------------------------------

@dataclasses.dataclass
class Req:
    lora_path: str
    prompt: list
    max_new_tokens: int
    output_ids: list = dataclasses.field(default_factory=list)

    def finished(self):
        return len(self.output_ids) >= self.max_new_tokens


def _serve(device, use_cuda_graph):
    model_runner = ModelRunner(device, disable_cuda_graph=not use_cuda_graph)
    gen = generator(3)

    def new_req(lora_path, prompt_len, max_new_tokens):
        return Req(lora_path, torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist(), max_new_tokens)

    r0, r1, r2, r3 = new_req("sql", 3, 5), new_req("chat", 5, 1), new_req("sql", 2, 3), new_req("chat", 4, 3)
    r4 = new_req("sql", 6, 2)
    outs = []

    def step(mode, reqs):
        if mode.is_extend():
            input_ids = [t for r in reqs for t in r.prompt]
            lens = [len(r.prompt) for r in reqs]
        else:
            input_ids, lens = [r.output_ids[-1] for r in reqs], None
        forward_batch = ForwardBatch.init_new(mode, input_ids, [r.lora_path for r in reqs], lens, model_runner)
        logits = model_runner.forward(forward_batch)
        next_ids = torch.argmax(logits, dim=-1).tolist()       # the sampler reads the logits before the next step
        outs.append(logits.clone())
        for r, t in zip(reqs, next_ids):
            r.output_ids.append(t)

    step(ForwardMode.EXTEND, [r0, r1, r2, r3])    # four requests; r1 (max_new_tokens=1) is done
    step(ForwardMode.DECODE, [r0, r2, r3])        # 3 requests: the bs-4 graph, one padded segment
    step(ForwardMode.DECODE, [r0, r2, r3])
    step(ForwardMode.EXTEND, [r4])
    step(ForwardMode.DECODE, [r0, r4])            # bs-2 graph
    step(ForwardMode.DECODE, [r0])                # bs-1 graph
    assert all(r.finished() for r in (r0, r1, r2, r3, r4))
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True), lambda: _serve(device, False))
