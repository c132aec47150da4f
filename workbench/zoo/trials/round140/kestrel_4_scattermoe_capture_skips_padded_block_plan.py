"""kestrel (m87-labs' Moondream inference engine) captures one decode CUDA graph per batch size. Its MoE layers run
ScatterMoE: ``MLP.forward`` sorts the token-to-expert assignments, then ``padded_block_indices`` turns the sorted
expert ids into a block plan (the first row of every expert's block) that both grouped GEMMs (``scatter2scatter``)
launch over. ``padded_block_indices`` could not be captured (a ``bincount`` that syncs, a ``torch._assert`` on a
tensor made from a Python number), so ``MLP.forward`` asked ``torch.cuda.is_current_stream_capturing()`` and, while
capturing, skipped it and handed the kernels the plan already sitting in the workspace. The captured graph therefore
contains the sort and the GEMMs but not the plan: every replay sorts the step's real routing and then runs the
GEMMs over the plan the last eager run (the capture's warmup on the dummy batch, or a later eager prefill) left in
the workspace. Rows whose expert block the stale plan does not start are never computed and keep old workspace
values, so decode logits under graphs differ from the same batch without graphs. The fix (PR #4) makes
``padded_block_indices`` capture-safe (``bincount`` as ``scatter_add_``, the assert dropped) and calls it on every
step, so the plan is recomputed inside the graph from the step's own routing.

Upstream: https://github.com/m87-labs/kestrel/pull/4 ("Fix KV cache writes and stabilise MoE CUDA graph replay",
repository m87-labs/kestrel, author vikhyat; description of 2025-10-09; squash-merged into main as commit
9659d3283d4cc10f1a34587d22b157fc3b8e2769, author date 2025-10-08). Read, in a mirror of the repository: the whole
diff of 9659d32 (``kestrel/scattermoe/mlp.py``: the ``capturing`` test and its ``if not capturing`` branch removed,
``padded_block_indices`` always called with ``out=self._workspace_up.padded_block_idxs``, comment "Always refresh
the padded block plan so CUDA graph replay picks up the current expert routing without changing tensor shapes";
``kestrel/scattermoe/kernels/ops.py``: ``compileable_bincount`` no longer a ``torch.library.custom_op`` around
``x.bincount`` but ``zeros(minlength).scatter_add_(0, x, ones)``, the ``torch._assert(torch.tensor(out.size(0),
device=...) >= total_blocks, ...)`` removed, ``@torch.compile`` dropped from ``flatten_and_sort`` and
``padded_block_indices``; ``kestrel/kv_cache.py``: ``PagedKVCache.update`` writes through expanded
page/head/slot indices; a benchmark script's metric names); the PR description in the stored corpus ("keep
ScatterMoE CUDA graph captures in sync by recomputing padded block indices each step and removing
torch.compile/custom-op paths that broke capture", tested with ``examples/consistency_probe.py --concurrency 8
--rounds 40``). At the parent fc4fb0c, whole: ``kestrel/scattermoe/mlp.py`` (``MLP.__init__``,
``ensure_workspaces``, ``forward``), ``scattermoe/workspace.py`` (``ScatterMoEWorkspace.allocate``),
``scattermoe/kernels/ops.py`` (``compileable_bincount``, ``flatten_and_sort``, ``padded_block_indices``, the Triton
``_scatter2scatter`` kernel, ``scatter2scatter``, ``scatter2scatter_compileable``), ``scattermoe/parallel_experts.py``
(``parallel_linear``, ``ParallelExperts``), ``moondream/layers.py`` (``layer_norm``, ``linear``, ``mlp``,
``build_moe_mlp``, ``moe_mlp``); in ``moondream/text.py`` ``text_encoder``, ``attn``, ``text_decoder``, ``lm_head``;
in ``moondream/runtime.py`` ``SequenceState``, ``RuntimeDecodeResult``, ``_GraphWorkspace``, ``start_sequence``,
``_prefill_impl``, ``decode_batch``, ``_build_flashinfer_metadata``, ``_decode_step``, ``_decode_with_graph``,
``_ensure_cuda_graphs_ready``, ``_initialize_graph_workspace``, ``_make_graph_batch_sizes``,
``_capture_decode_graphs``, ``_select_graph_batch_size`` and ``_clear_graph_inputs``.
Not read: any issue behind the PR (none is linked, and none was found in the stored corpus), a review of the PR
(none stored), ``examples/consistency_probe.py`` (not in the tree at fc4fb0c), the rest of ``kv_cache.py`` and the
page table, ``moondream/flashinfer.py``, the scheduler and sampler, the vision encoder, ``weights.py``. No user report
was found: the symptom below is what the parent's code does, read line by line, and what the PR names.
Symptom: with CUDA graphs on (the default), decode through the MoE layers is not kept "in sync" with the step
(the PR's words): the graph replays the GEMMs over a block plan computed for another routing, so some rows of each MoE
layer keep stale workspace values and logits (and with them greedy tokens) differ from the run without graphs; the PR
title calls the fix "stabilise MoE CUDA graph replay", and it was checked with a consistency probe at concurrency 8.
No error is raised.
Mechanism: the runtime captures its decode graphs at start-up, largest batch first, each after one eager warmup of
the same step on the dummy batch (all tokens 0 at position 0). In the warmup ``moe_mlp`` sizes the workspaces and
``MLP.forward`` (not capturing) computes ``padded_block_indices`` into ``workspace_up.padded_block_idxs`` for the
dummy routing (every token picks the same experts). In the capture, ``capturing`` is True: the sort and the copies
into the workspace's sorted buffers are recorded, ``padded_block_indices`` is not, and both ``scatter2scatter``
launches read the workspace plan as it is. Every replay then sorts the real batch's routing and runs the grouped
GEMMs over the plan of whatever eager run last wrote the workspace (eager prefills of short prompts share it). A
``_scatter2scatter`` program starting at a stale block start computes only the rows of the smallest expert inside
its window; rows of experts no stale start covers are not written and keep the workspace output of an earlier run.
Doctor: warmup-divergence, at ``forward``. The captured step does other work than the eager step: the branch taken
at capture (``capturing``) leaves the block-plan computation out of the graph, so the plan used on every replay is
the one chosen by the warmup (or the last eager run), not the replay's. ``MLP.forward`` is where this is decided and
what the fix changes (the two kernel-side changes in ``ops.py`` only make the plan computation capturable).
Fix (upstream): in ``MLP.forward`` drop ``capturing`` and always call ``padded_block_indices(sorted_expert_buffer,
num_experts, out=workspace_up.padded_block_idxs, block_idx_template=workspace_up.block_idx_template)``; in ``ops.py``
replace ``bincount`` by a ``scatter_add_`` count and remove the host-side assert and the ``torch.compile`` wrappers.
Modelled: kestrel's ``MLP`` (``__init__``, ``ensure_workspaces``, ``forward``), ``ScatterMoEWorkspace.allocate``,
``compileable_bincount`` (both versions), ``flatten_and_sort``, ``padded_block_indices`` (both versions),
``scatter2scatter`` / ``scatter2scatter_compileable`` / ``_scatter2scatter``, ``parallel_linear``,
``ParallelExperts``, ``layer_norm``, ``linear``, ``mlp``, ``build_moe_mlp``, ``moe_mlp``, ``text_encoder``,
``text_decoder``, ``lm_head``, ``SequenceState``, ``RuntimeDecodeResult``, ``_GraphWorkspace`` and
``MoondreamRuntime`` (``start_sequence``, ``_prefill_impl``, ``decode_batch``, ``_decode_step``,
``_decode_with_graph``, ``_ensure_cuda_graphs_ready``, ``_initialize_graph_workspace``, ``_make_graph_batch_sizes``,
``_capture_decode_graphs``, ``_select_graph_batch_size``, ``_clear_graph_inputs``).
Stand-ins: the Triton ``_scatter2scatter`` kernel is written in torch with the kernel's semantics: for every slot of
the plan, a start at or past ``FAN_OUT * M`` does nothing, otherwise the window of ``BLOCK_M`` rows from the start
is computed for the rows whose expert equals the smallest expert id in the window, and other rows are not stored.
Upstream's ``capturing`` also requires ``x.is_cuda and torch.cuda.is_available()``, true on its only backend; the
test here is ``torch.cuda.is_current_stream_capturing()`` alone, which the CPU emulation answers as CUDA does, so
both devices take the path a real capture takes. ``torch.compile`` on ``flatten_and_sort`` and
``padded_block_indices`` and the custom-op wrappers are left out (eager). The text model is three float64 blocks
(width 16, vocab 24; block 0 dense, blocks 1-2 MoE with 4 experts, top-2, expert width 8, gated GELU as upstream);
attention, the paged KV cache (and the PR's separate ``PagedKVCache.update`` fix), FlashInfer planning, rotary
embeddings, the BOS token and images are left out, and a learned position table stands in for the positional signal,
so the decode graph reads the token and position buffers (``_GraphWorkspace`` has no batch-index buffer, which only
the left-out attention reads). The page table is a counter; batch index 0 stays reserved
as upstream (``max_batch_size - 1`` effective rows). The graphs share one pool handle (upstream: the first graph's
``pool()``). Sampling is greedy argmax; the scheduler is a loop over ``decode_batch``. Linear layers (router, dense
MLP, LM head) are per-row multiply-sums so that the padded graph batch and the unpadded eager batch round alike.
Workload: three requests (prompts of 3, 4 and 2 tokens; 6, 5 and 3 new tokens) prefilled one by one (eagerly; the
prompts fit the workspaces the capture sized, so the prefills write the shared plan buffer) and then decoded together,
so the batch shrinks 3 -> 2 -> 1 and replays the graphs of sizes 4, 2 and 1 (padded; the runner zeroes the padded
rows of its input buffers before each replay). Eager is the same runtime with ``enable_cuda_graphs=False``. Outputs:
every decode step's logits and the generated tokens per request.
Measured: bug: misbehaves (max |graph - eager| = 12): the graphs of both MoE layers replay over the plan of the last
eager run, the 2-token prompt's prefill ([0, 1, 2, 4, 4, 4, 4, 4], whose sentinel 4 is a live start in the 8-row
batch of the size-4 graph); from the first decode step some expert rows keep old workspace values, logits differ by up
to 0.62 and greedy tokens diverge (a generated token id off by 12). Fix: equals eager (max |graph - eager| = 0). About
1.5-2 s per variant on the CPU (the run without graphs included).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/m87-labs/kestrel/pull/4"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "forward"
SYMPTOM = ("with decode CUDA graphs on, ScatterMoE's MLP.forward skips the padded-block plan while capturing, so "
           "every replay runs the grouped expert GEMMs over the plan the warmup (or the last eager run) left in the "
           "workspace: rows of experts the stale plan does not cover keep old values and decode logits differ")

DTYPE = torch.float64
VOCAB, DIM, N_LAYERS = 24, 16, 3
MOE_START_LAYER, NUM_EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INNER_DIM = 1, 4, 2, 8
MAX_BATCH_SIZE, MAX_SEQ_LENGTH = 5, 16
BLOCK_M = 128
PROMPTS = ([3, 17, 8], [11, 2, 20, 5], [9, 14])
MAX_NEW_TOKENS = (6, 5, 3)
_variant = "bug"


# --- kestrel/scattermoe/kernels/ops.py ------------------------------------------------------------------------------

def compileable_bincount(x: Tensor, minlength: int) -> Tensor:
    if _variant == "bug":
        return x.bincount(minlength=minlength)          # upstream: a custom op; syncs on CUDA, so not capturable
    counts = torch.zeros(minlength, dtype=torch.long, device=x.device)   # PR #4
    if x.numel() == 0:
        return counts
    ones = torch.ones_like(x, dtype=torch.long)
    counts.scatter_add_(0, x, ones)
    return counts


def flatten_and_sort(expert_idxs: Tensor) -> tuple[Tensor, Tensor]:
    flattened = expert_idxs.reshape(-1)
    return torch.sort(flattened)


def padded_block_indices(sorted_expert_idxs: Tensor, k: int, N_BLOCK_SIZE: int = BLOCK_M, *,
                         out: Tensor | None = None, block_idx_template: Tensor | None = None):
    expert_counts = compileable_bincount(sorted_expert_idxs, minlength=k)
    padded_block_counts = ((expert_counts - 1) // N_BLOCK_SIZE) + 1
    padded_expert_block_end = padded_block_counts.cumsum(-1)
    expert_boundaries_end = expert_counts.cumsum(-1)
    expert_boundaries_start = expert_boundaries_end - expert_counts
    padded_expert_block_start = padded_expert_block_end - padded_block_counts

    total_blocks = padded_expert_block_end[-1]

    if out is None:
        block_idxs = torch.arange(total_blocks, dtype=sorted_expert_idxs.dtype, device=sorted_expert_idxs.device)
    else:
        if out.dim() != 1 or out.dtype != torch.long:
            raise ValueError("Output buffer for padded_block_indices must be 1D long tensor")
        if block_idx_template is not None and block_idx_template.size(0) != out.size(0):
            raise ValueError("block_idx_template must match out buffer shape")
        if _variant == "bug":                           # removed by PR #4
            torch._assert(torch.tensor(out.size(0), device=total_blocks.device, dtype=total_blocks.dtype)
                          >= total_blocks, "Output buffer has fewer slots than required blocks")
        block_idxs = (block_idx_template if block_idx_template is not None else
                      torch.arange(out.size(0), dtype=sorted_expert_idxs.dtype, device=sorted_expert_idxs.device))

    block_mask = (block_idxs[:, None] < padded_expert_block_start) | (block_idxs[:, None] >= padded_expert_block_end)
    inactive_mask = block_idxs >= total_blocks
    block_mask = block_mask | inactive_mask[:, None]

    expanded_block_idxs = N_BLOCK_SIZE * (block_idxs[:, None] - padded_expert_block_start) + expert_boundaries_start
    sentinel = sorted_expert_idxs.size(0)
    expanded_block_idxs = expanded_block_idxs.masked_fill(block_mask, sentinel)
    expanded_block_idxs = expanded_block_idxs.min(dim=-1).values

    if out is not None:
        out.copy_(expanded_block_idxs)
        return out, expert_boundaries_end, total_blocks
    return expanded_block_idxs, expert_boundaries_end, total_blocks


def _scatter2scatter(X, W, Y, grouped_idx, expert_idxs, block_start_idx, FAN_OUT, x_grouped, y_grouped):
    """The Triton kernel, one program per slot of ``block_start_idx`` (stand-in, written in torch): a start at or
    past ``FAN_OUT * M`` returns; otherwise the ``BLOCK_M`` rows from the start are loaded, ``E_idx`` is the smallest
    expert id among them, and only the rows of that expert are computed and stored."""
    E = W.size(0)
    length = expert_idxs.size(0)
    rows = torch.arange(length, device=X.device)
    starts = block_start_idx[:, None]
    active = block_start_idx < FAN_OUT * X.size(0)
    in_window = (rows[None, :] >= starts) & (rows[None, :] < starts + BLOCK_M) & active[:, None]
    E_idxs = expert_idxs[None, :].expand(block_start_idx.size(0), length).masked_fill(~in_window, E)
    E_idx = E_idxs.min(dim=1).values
    E_mask = in_window & (E_idxs == E_idx[:, None])
    stored = E_mask.any(dim=0)                          # rows some program computes (always with their own expert)

    M_idx = grouped_idx
    M_in_idx = rows if x_grouped else M_idx // FAN_OUT
    M_out_idx = rows if y_grouped else M_idx
    acc = torch.bmm(X[M_in_idx].unsqueeze(1), W[expert_idxs]).squeeze(1)
    Y.index_put_((M_out_idx,), torch.where(stored[:, None], acc, Y[M_out_idx]))


def scatter2scatter_compileable(O, W, X, k, padded_block_idxs, sorted_expert_idxs, sorted_scattered_idxs,
                                x_grouped, y_grouped) -> None:
    _scatter2scatter(X, W, O, grouped_idx=sorted_scattered_idxs, expert_idxs=sorted_expert_idxs,
                     block_start_idx=padded_block_idxs, FAN_OUT=k, x_grouped=x_grouped, y_grouped=y_grouped)


def scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, padded_block_idxs, *, x_grouped=False,
                    y_grouped=False, out=None):
    assert sorted_scattered_idxs.size(0) == sorted_expert_idxs.size(0)
    assert sorted_scattered_idxs.size(0) == X.size(0) * k
    y_dim = W.size(-1)
    length = sorted_expert_idxs.size(0)
    if out is None:
        out = torch.empty((length, y_dim), device=X.device, dtype=X.dtype)
    elif out.size(0) != length or out.size(1) != y_dim:
        raise ValueError("Provided output tensor has incompatible shape")
    scatter2scatter_compileable(out, W, X, k, padded_block_idxs, sorted_expert_idxs, sorted_scattered_idxs,
                                x_grouped, y_grouped)
    return out


# --- kestrel/scattermoe/parallel_experts.py, workspace.py, mlp.py --------------------------------------------------

def parallel_linear(inputs, expert_weights, k, sorted_expert_idxs, sorted_scattered_idxs, padded_block_idxs, *,
                    gates=None, grouped_in=False, grouped_out=False, out=None):
    output = scatter2scatter(inputs, expert_weights, sorted_expert_idxs, sorted_scattered_idxs, k,
                             padded_block_idxs, x_grouped=grouped_in, y_grouped=grouped_out, out=out)
    if gates is not None:
        expanded = output.view(gates.size(0), gates.size(1), output.size(-1))
        output = torch.bmm(gates.unsqueeze(1), expanded).squeeze(1)
    return output


class ParallelExperts(nn.Module):
    def __init__(self, num_experts, input_size, output_size, *, dtype=DTYPE):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, output_size, input_size, dtype=dtype))
        self.num_experts, self.input_size, self.output_size = num_experts, input_size, output_size

    def forward(self, inputs, k, sorted_expert_idxs, sorted_scattered_idxs, padded_block_idxs, *, gates=None,
                grouped_in=False, grouped_out=False, out=None):
        expert_weights = self.weight.permute(0, 2, 1)
        return parallel_linear(inputs, expert_weights, k, sorted_expert_idxs, sorted_scattered_idxs,
                               padded_block_idxs, gates=gates, grouped_in=grouped_in, grouped_out=grouped_out,
                               out=out)


@dataclass
class ScatterMoEWorkspace:
    """Reusable buffers to make ScatterMoE launches CUDA-graph friendly."""

    sorted_expert_idxs: Tensor
    sorted_scattered_idxs: Tensor
    padded_block_idxs: Tensor
    block_idx_template: Tensor
    output: Tensor
    max_tokens: int
    top_k: int

    @classmethod
    def allocate(cls, *, batch_tokens, hidden_size, top_k, device, dtype):
        length = max(batch_tokens * top_k, 1)
        padded_block_capacity = length
        return cls(
            sorted_expert_idxs=torch.empty(length, dtype=torch.long, device=device),
            sorted_scattered_idxs=torch.empty(length, dtype=torch.long, device=device),
            padded_block_idxs=torch.empty(padded_block_capacity, dtype=torch.long, device=device),
            block_idx_template=torch.arange(padded_block_capacity, dtype=torch.long, device=device),
            output=torch.empty(length, hidden_size, dtype=dtype, device=device),
            max_tokens=batch_tokens, top_k=top_k)


class MLP(nn.Module):
    def __init__(self, input_size, hidden_size, num_experts, top_k, *, activation=None, dtype=DTYPE):
        super().__init__()
        self.num_experts, self.input_size, self.hidden_size = num_experts, input_size, hidden_size
        self.experts = ParallelExperts(num_experts, input_size, hidden_size * 2, dtype=dtype)
        self.output_experts = ParallelExperts(num_experts, hidden_size, input_size, dtype=dtype)
        self.top_k = min(top_k, self.num_experts)
        self.activation = activation or nn.GELU()
        self._workspace_tokens: int = 0
        self._workspace_device: torch.device | None = None
        self._workspace_dtype: torch.dtype | None = None
        self._workspace_up: Optional[ScatterMoEWorkspace] = None
        self._workspace_down: Optional[ScatterMoEWorkspace] = None

    def ensure_workspaces(self, batch_tokens, device, dtype) -> None:
        if batch_tokens <= 0:
            batch_tokens = 1
        reuse = (self._workspace_up is not None and self._workspace_down is not None
                 and self._workspace_tokens >= batch_tokens and self._workspace_device == device
                 and self._workspace_dtype == dtype)
        if reuse:
            return
        self._workspace_tokens, self._workspace_device, self._workspace_dtype = batch_tokens, device, dtype
        self._workspace_up = ScatterMoEWorkspace.allocate(batch_tokens=batch_tokens, hidden_size=self.hidden_size * 2,
                                                          top_k=self.top_k, device=device, dtype=dtype)
        self._workspace_down = ScatterMoEWorkspace.allocate(batch_tokens=batch_tokens, hidden_size=self.input_size,
                                                            top_k=self.top_k, device=device, dtype=dtype)

    def forward(self, x: Tensor, expert_p: Tensor, expert_idxs: Tensor):
        x_shape = x.size()
        x = x.view(-1, x_shape[-1])
        with torch.no_grad():
            sorted_expert_idxs, sorted_scattered_idxs = flatten_and_sort(expert_idxs)

            use_workspace = (self._workspace_up is not None and self._workspace_down is not None
                             and self._workspace_device == x.device and self._workspace_dtype == x.dtype
                             and self._workspace_tokens >= x.size(0))
            # upstream: x.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            capturing = torch.cuda.is_current_stream_capturing()

            if use_workspace:
                length = sorted_expert_idxs.size(0)
                sorted_expert_buffer = self._workspace_up.sorted_expert_idxs[:length]
                sorted_scattered_buffer = self._workspace_up.sorted_scattered_idxs[:length]
                sorted_expert_buffer.copy_(sorted_expert_idxs)
                sorted_scattered_buffer.copy_(sorted_scattered_idxs)
                if _variant == "fix" or not capturing:
                    # PR #4: "Always refresh the padded block plan so CUDA graph replay picks up the current expert
                    # routing without changing tensor shapes."
                    padded_block_idxs, _, _ = padded_block_indices(
                        sorted_expert_buffer, self.num_experts, out=self._workspace_up.padded_block_idxs,
                        block_idx_template=self._workspace_up.block_idx_template)
                else:
                    padded_block_idxs = self._workspace_up.padded_block_idxs
                sorted_expert_for_kernel = sorted_expert_buffer
                sorted_scattered_for_kernel = sorted_scattered_buffer
            else:
                padded_block_idxs, _, _ = padded_block_indices(sorted_expert_idxs, self.num_experts)
                sorted_expert_for_kernel = sorted_expert_idxs
                sorted_scattered_for_kernel = sorted_scattered_idxs

        length = sorted_expert_idxs.size(0)
        expert_out = self.experts(
            x, self.top_k, sorted_expert_for_kernel, sorted_scattered_for_kernel, padded_block_idxs,
            grouped_out=True, out=self._workspace_up.output[:length] if use_workspace else None)
        h, g = expert_out[:length].chunk(2, dim=-1)
        h = self.activation(h) * (g + 1)
        y = self.output_experts(
            h, 1, sorted_expert_for_kernel, sorted_scattered_for_kernel, padded_block_idxs, grouped_in=True,
            gates=expert_p, out=self._workspace_down.output[:length] if use_workspace else None)
        return y.view(*x_shape[:-1], y.size(-1))


# --- kestrel/moondream/layers.py, text.py (reduced) -----------------------------------------------------------------

def layer_norm(x, w):
    return F.layer_norm(x, w.bias.shape, w.weight, w.bias)


def linear(x, w):
    """``F.linear`` as a per-row multiply-sum (stand-in): a row's result does not depend on how many rows the call
    has, so the padded graph batch and the unpadded eager batch give real rows the same bits (a BLAS GEMM picks its
    kernel by the row count)."""
    return (x.unsqueeze(-2) * w.weight).sum(-1) + w.bias


def mlp(x, w):
    return linear(F.gelu(linear(x, w["fc1"]), approximate="tanh"), w["fc2"])


def build_moe_mlp(d_model, d_ffn, n_experts, dtype, *, top_k):
    return nn.ModuleDict({"router": nn.Linear(d_model, n_experts, dtype=dtype),
                          "mlp": MLP(input_size=d_model, hidden_size=d_ffn, num_experts=n_experts, top_k=top_k,
                                     dtype=dtype)})


def moe_mlp(x, mlp_module, experts_per_token, *, mode="decode"):
    B, T, C = x.shape
    x_flat = x.reshape(-1, C)
    router, scatter_mlp = mlp_module["router"], mlp_module["mlp"]
    router_logits = linear(x_flat, router)             # upstream: router(x_flat)
    topk_logits, topk_idxs = torch.topk(router_logits, experts_per_token, dim=-1)
    topk_weights = F.softmax(topk_logits, dim=-1, dtype=torch.float32).to(x.dtype)
    num_tokens = topk_idxs.shape[0]
    if mode == "decode":
        scatter_mlp.ensure_workspaces(num_tokens, x_flat.device, x_flat.dtype)
    return scatter_mlp(x_flat, topk_weights, topk_idxs).view(B, T, C)


def build_text_model(device) -> nn.Module:
    gen = generator(4)
    blocks = []
    for i in range(N_LAYERS):
        block = nn.ModuleDict({"ln": nn.LayerNorm(DIM, dtype=DTYPE)})
        if i >= MOE_START_LAYER:
            block["mlp"] = build_moe_mlp(DIM, EXPERT_INNER_DIM, NUM_EXPERTS, DTYPE, top_k=EXPERTS_PER_TOKEN)
        else:
            block["mlp"] = nn.ModuleDict({"fc1": nn.Linear(DIM, 2 * DIM, dtype=DTYPE),
                                          "fc2": nn.Linear(2 * DIM, DIM, dtype=DTYPE)})
        blocks.append(block)
    text = nn.ModuleDict({"blocks": nn.ModuleList(blocks), "post_ln": nn.LayerNorm(DIM, dtype=DTYPE),
                          "lm_head": nn.Linear(DIM, VOCAB, dtype=DTYPE)})
    text.wte = nn.Parameter(torch.empty(VOCAB, DIM, dtype=DTYPE))
    text.wpe = nn.Parameter(torch.empty(MAX_SEQ_LENGTH, DIM, dtype=DTYPE))      # stand-in for rotary positions
    with torch.no_grad():
        for name, p in text.named_parameters():
            scale = 1.0 if name.endswith(("wte", "wpe")) or "router" in name else 0.4
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DTYPE) * scale)
    return text.to(device)


def text_encoder(input_ids: Tensor, module: nn.Module) -> Tensor:
    return F.embedding(input_ids, module.wte)


def text_decoder(x, module, position_ids, *, mode="decode"):
    x = x + module.wpe[position_ids]
    for i, block in enumerate(module.blocks):
        x_norm = layer_norm(x, block.ln)
        if i >= MOE_START_LAYER:
            mlp_out = moe_mlp(x_norm, block.mlp, EXPERTS_PER_TOKEN, mode=mode)
        else:
            mlp_out = mlp(x_norm, block.mlp)
        x = x + mlp_out                                 # upstream: x + attn_out + mlp_out (attention left out)
    return x


def lm_head(hidden: Tensor, module: nn.Module) -> Tensor:
    hidden_norm = layer_norm(hidden[:, -1, :], module.post_ln)
    return linear(hidden_norm, module.lm_head)          # upstream: module.lm_head(hidden_norm)


# --- kestrel/moondream/runtime.py (reduced) -------------------------------------------------------------------------

class RuntimeDecodeResult(NamedTuple):
    logits: Tensor
    hidden: Tensor


@dataclass
class SequenceState:
    batch_idx: int
    length: int
    max_length: int
    prompt_length: int | None = None
    last_hidden: Tensor | None = None

    def advance(self, tokens: int = 1) -> None:
        self.length += tokens

    def at_capacity(self) -> bool:
        return self.length >= self.max_length


@dataclass
class _GraphWorkspace:
    token_buffer: Tensor
    position_buffer: Tensor
    output_buffer: Tensor
    hidden_buffer: Tensor


@dataclass
class RuntimeConfig:
    device: str
    enable_cuda_graphs: bool = True
    max_batch_size: int = MAX_BATCH_SIZE
    max_seq_length: int = MAX_SEQ_LENGTH


@dataclass
class MoondreamRuntime:
    cfg: RuntimeConfig
    model: nn.Module
    active_sequences: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.cfg.device)
        self.max_batch_size = self.cfg.max_batch_size
        self._next_batch_idx = 1                       # page table stand-in: batch index 0 is reserved
        self._use_cuda_graphs = self.cfg.enable_cuda_graphs
        self._graph_workspace: _GraphWorkspace | None = None
        self._cuda_graphs: dict[int, object] = {}
        self._graph_outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self._graph_batch_sizes: list[int] = []
        self._graph_pool = None
        if self._use_cuda_graphs:
            self._ensure_cuda_graphs_ready()

    def start_sequence(self, prompt_tokens: list[int], *, max_new_tokens: int):
        tokens_view = torch.tensor([prompt_tokens], device=self.device, dtype=torch.long)
        inputs_embeds = text_encoder(tokens_view, self.model)
        prompt_len = inputs_embeds.shape[1]
        batch_idx, self._next_batch_idx = self._next_batch_idx, self._next_batch_idx + 1
        position_ids = torch.arange(prompt_len, dtype=torch.long, device=self.device).unsqueeze(0)
        hidden, logits = self._prefill_impl(inputs_embeds, position_ids)
        state = SequenceState(batch_idx=batch_idx, length=prompt_len, max_length=prompt_len + max_new_tokens,
                              prompt_length=prompt_len, last_hidden=hidden[:, -1, :].squeeze(0).detach())
        self.active_sequences[batch_idx] = state
        return state, logits

    def release_sequence(self, state: SequenceState) -> None:
        self.active_sequences.pop(state.batch_idx, None)

    def _prefill_impl(self, inputs_embeds, position_ids):
        hidden = text_decoder(inputs_embeds, self.model, position_ids, mode="prefill")
        return hidden, lm_head(hidden, self.model)

    def decode_batch(self, states, token_inputs: Tensor) -> Tensor:
        input_pos = torch.tensor([s.length for s in states], device=self.device, dtype=torch.int32)
        tokens_tensor = token_inputs.view(-1).to(device=self.device, dtype=torch.long)
        batch_size = len(states)
        if self._use_cuda_graphs and batch_size > 0:
            graph_batch_size = self._select_graph_batch_size(batch_size)
            if graph_batch_size is not None and self._cuda_graphs:
                result = self._decode_with_graph(tokens_tensor, input_pos, graph_batch_size)
            else:
                result = self._decode_step(tokens_tensor, input_pos)
        else:
            result = self._decode_step(tokens_tensor, input_pos)
        for state, vec in zip(states, result.hidden[:, -1, :]):
            state.last_hidden = vec.detach()
        return result.logits

    def _decode_step(self, token_inputs: Tensor, input_pos: Tensor, *, use_graph: bool = False):
        embeds = text_encoder(token_inputs.view(-1, 1), self.model)
        position_ids = input_pos.to(dtype=torch.long).view(-1, 1)
        hidden = text_decoder(embeds, self.model, position_ids, mode="decode")
        return RuntimeDecodeResult(logits=lm_head(hidden, self.model), hidden=hidden)

    def _decode_with_graph(self, tokens, input_pos, graph_batch_size):
        workspace = self._graph_workspace
        batch_size = tokens.shape[0]
        self._clear_graph_inputs(graph_batch_size)
        workspace.token_buffer[:batch_size, 0].copy_(tokens)
        workspace.position_buffer[:batch_size].copy_(input_pos)
        logits, hidden = replay(self._cuda_graphs[graph_batch_size], self._graph_outputs[graph_batch_size],
                                real=batch_size, size=graph_batch_size)
        return RuntimeDecodeResult(logits=logits[:batch_size].clone(),
                                   hidden=hidden[:batch_size].clone().unsqueeze(1))

    def _ensure_cuda_graphs_ready(self) -> None:
        if not self._use_cuda_graphs or self._cuda_graphs:
            return
        self._initialize_graph_workspace()
        self._capture_decode_graphs()

    def _initialize_graph_workspace(self) -> None:
        max_effective_batch = max(1, self.max_batch_size - 1)
        self._graph_workspace = _GraphWorkspace(
            token_buffer=torch.zeros((max_effective_batch, 1), device=self.device, dtype=torch.long),
            position_buffer=torch.zeros((max_effective_batch,), device=self.device, dtype=torch.int32),
            output_buffer=torch.zeros((max_effective_batch, VOCAB), device=self.device, dtype=DTYPE),
            hidden_buffer=torch.zeros((max_effective_batch, DIM), device=self.device, dtype=DTYPE))
        self._graph_batch_sizes = self._make_graph_batch_sizes(max_effective_batch)

    def _make_graph_batch_sizes(self, max_batch: int) -> list[int]:
        seeds = [size for size in (1, 2, 4, 8) if size <= max_batch]
        ramps = list(range(16, max_batch + 1, 16))
        return sorted({*seeds, *ramps, max_batch})

    def _capture_decode_graphs(self) -> None:
        workspace = self._graph_workspace
        workspace.token_buffer.zero_()
        workspace.position_buffer.zero_()
        events.static_buffers("MoondreamRuntime", {"token_buffer": workspace.token_buffer,
                                                   "position_buffer": workspace.position_buffer})
        self._graph_pool = graph_pool_handle(self.device)
        for bs in reversed(self._graph_batch_sizes):
            def step(bs=bs):
                out = self._decode_step(workspace.token_buffer[:bs, 0], workspace.position_buffer[:bs],
                                        use_graph=True)
                workspace.output_buffer[:bs].copy_(out.logits)
                workspace.hidden_buffer[:bs].copy_(out.hidden[:, 0, :])
                return workspace.output_buffer[:bs], workspace.hidden_buffer[:bs]

            # one eager warmup on the dummy batch, then the capture (upstream: with the shared graph pool)
            graph, outputs = capture(step, device=str(self.device), pool=self._graph_pool, warmups=1,
                                     name=f"decode bs={bs}")
            self._cuda_graphs[bs], self._graph_outputs[bs] = graph, outputs
        self._clear_graph_inputs(0)

    def _select_graph_batch_size(self, batch_size: int) -> int | None:
        for size in self._graph_batch_sizes:
            if size >= batch_size:
                return size
        return None

    def _clear_graph_inputs(self, limit: int) -> None:
        workspace = self._graph_workspace
        if limit <= 0:
            limit = workspace.token_buffer.shape[0]
        workspace.token_buffer[:limit].zero_()
        workspace.position_buffer[:limit].zero_()
        workspace.hidden_buffer[:limit].zero_()


# --- the serving loop (stand-in for kestrel's scheduler: greedy sampling) -------------------------------------------

def serve(device: str, enable_cuda_graphs: bool) -> list[Tensor]:
    with torch.inference_mode():
        runtime = MoondreamRuntime(RuntimeConfig(device=device, enable_cuda_graphs=enable_cuda_graphs),
                                   build_text_model(device))
        running, logits_seen, generated = [], {}, {}
        for prompt, max_new in zip(PROMPTS, MAX_NEW_TOKENS):
            state, logits = runtime.start_sequence(prompt, max_new_tokens=max_new)
            running.append((state, logits.argmax(dim=-1)))
            logits_seen[state.batch_idx], generated[state.batch_idx] = [], []
        while running:
            states = [state for state, _ in running]
            tokens = torch.cat([token for _, token in running])
            logits = runtime.decode_batch(states, tokens)
            next_tokens = logits.argmax(dim=-1, keepdim=True)
            still = []
            for i, state in enumerate(states):
                state.advance()
                logits_seen[state.batch_idx].append(logits[i])
                generated[state.batch_idx].append(tokens[i])
                if state.at_capacity():
                    runtime.release_sequence(state)
                else:
                    still.append((state, next_tokens[i]))
            running = still
        outputs = []
        for idx in sorted(logits_seen):
            outputs.append(torch.stack(logits_seen[idx]).clone())
            outputs.append(torch.stack(generated[idx]).to(DTYPE).clone())
        return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: serve(device, enable_cuda_graphs=True),
                       lambda: serve(device, enable_cuda_graphs=False))
    finally:
        _variant = "bug"
