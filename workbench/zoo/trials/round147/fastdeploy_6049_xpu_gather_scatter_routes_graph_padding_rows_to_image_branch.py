"""FastDeploy's ERNIE-4.5-VL model splits every MoE layer's tokens by modality: ``text_image_index_out`` numbers the
text rows and the image rows of a step, ``text_image_gather_scatter(..., True)`` copies each hidden row into the text or
the image expert input at its number, the two expert blocks run, and ``text_image_gather_scatter(..., False)`` copies
their outputs back. The modality of a row is ``token_type_ids`` (0 text, 1 image), kept in a CUDA-graph buffer that
``Ernie4_5_VLModel.prepare_vl_moe_meta`` fills with ``-1`` over the largest capture size before copying the step's
real types in: a decode batch replayed in a larger graph sees ``-1`` in its padded rows, and the CUDA kernels skip
them ("skip cuda graph padding value"). The Kunlun XPU kernel of ``text_image_gather_scatter`` tested only
``token_type == 0`` and took every other row, ``-1`` included, for an image row. On XPU with CUDA graphs (added there
the day before the fix) a padded decode step therefore routes its padding rows through the image branch: their image
numbers (which the XPU ``text_image_index_out`` hands to every non-text row) point past the image expert's output,
which has the rows of the step's real image tokens -- none in a decode graph captured on text tokens. The fix makes
the XPU kernel skip rows of any type other than 0 and 1, as the CUDA kernel does.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/6049 ("[XPU] fix text_image_gather_scatter in cudagraph
mode", repository PaddlePaddle/FastDeploy, author RuohengMa, opened 2026-01-15, approved 2026-01-15 and 2026-01-23,
merged; squash commit 976203cf6 "[XPU ]fix text_image_gather_scatter in cudagraph mode(#6049)", 2026-01-23, which I
read in a mirror of the fork gongshaotian/FastDeploy, whose develop history carries upstream's commits). Read: the
whole diff of 976203cf6 (``custom_ops/xpu_ops/src/plugin/src/kernel/kunlun3cpp/text_image_gather_scatter.xpu``:
``text_image_gather`` and ``text_image_scatter`` get ``else if (token_type == 1) ... else { continue; }``); at
976203cf6: the rest of that kernel, its wrapper ``plugin/src/wrapper/text_image_gather_scatter.cpp`` (the CPU wrapper,
still ``else {  // token_type == 1``, and the size assertion), the op ``xpu_ops/src/ops/text_image_gather_scatter.cc``
(token, text and image counts taken from the tensors' first dimensions), the XPU ``text_image_index_out`` kernel and
wrapper (every row whose type is not 0 gets the next image number), the CUDA kernels ``gpu_ops/text_image_gather_
scatter.cu`` and ``gpu_ops/text_image_index_out.cu`` (both skip any other type: "skip cuda graph padding value"), and
in ``fastdeploy/model_executor/models/ernie4_5_vl/ernie4_5_vl_moe.py``: ``VLMoEMeta``, ``Ernie4_5_VLMoE.forward``,
``Ernie4_5_VLDecoderLayer.forward``, the ``@cuda_graph_buffers`` table (``token_type_ids`` filled with -1, the text and
image input buffers of ``max_model_len`` rows), ``Ernie4_5_VLModel.prepare_vl_moe_meta`` and ``forward``,
``Ernie4_5_VLMoeForConditionalGeneration.__init__`` (``_decoder_input_embeddings``), ``get_input_embeddings`` and
``forward``; ``graph_optimization/cudagraph_piecewise_backend.py`` (``CudaGraphPiecewiseBackend.__call__``: real shape
from ``ids_remove_padding``, ``real_shape_to_captured_size``, warmups, capture, replay, output buffers); and in
``fastdeploy/worker/xpu_model_runner.py``: ``_prepare_inputs``'s ``step_use_cudagraph`` (decode-only batches),
``capture_model``, ``_dummy_run``/``_dummy_prefill_inputs`` (dummy token id 5), ``execute_model``
(``model_output[: self.real_token_num]``) and ``padding_cudagraph_inputs``. Also the PR page (no text beyond the
title) and that of #6152 ("[XPU][Graph Optimization] XPU Support CUDAGraph", merged 2026-01-22, naming the VL 28B
model among those sped up).
Not read: the PR's review threads (two LGTMs only), Paddle's ``copy_`` and CUDA-graph internals, the attention
backends and their decode buffers, ``Ernie4_5_VLMoeBlock``'s experts and the fused-MoE kernels, the resampler and the
vision model, the XPU ``xpu_pre_process``. What the XPU showed is not reported anywhere I found.
Symptom: none reported in words (the PR title only). My reading of the code: on a Kunlun XPU with CUDA graphs, the
first ERNIE-4.5-VL decode step whose batch is padded to a larger captured size reads rows past the image expert's
output (here a zero-row tensor) for its padding rows: a device fault, or garbage in rows nobody reads; batches of
exactly a captured size, and runs without graphs, are right.
Mechanism: the decode graph of size S is captured on a dummy batch of S text tokens, so the captured views are
``token_type_ids[:S]``, ``text_input[:S]`` and ``image_input[:0]``. At a step of R < S real tokens the runner writes
R types and ``prepare_vl_moe_meta`` leaves -1 in rows R..S-1; the replayed ``text_image_index_out`` (XPU: not 0 means
image) numbers those rows 0, 1, ... as image rows; ``text_image_gather_scatter`` before the fix then reads
``image_out[image_index[i]]`` for each of them, beyond the expert output's zero rows. Without graphs a step has no
padding rows, and a graph of exactly R rows has none either.
Doctor: padded-shape-mismatch, at ``text_image_gather_scatter``: run at the graph's padded token count, the kernel
combines the padding rows (their -1 type, their image numbers) with the image expert's output, sized by the step's
real image tokens; the function decides it by not skipping the graph's padding value, and it is the function the
fix changes. (Not stale-padding: the padding rows hold exactly what the runner put there, -1, and nothing stale
reaches a real row; not undersized-buffer: no data of the step exceeds a buffer, padding rows are indexed into a
tensor that was never meant to hold them.)
Fix (upstream): in both device functions of the XPU kernel, ``else if (token_type == 1)`` takes the image branch and
any other type ``continue``s; ``text_image_index_out`` and the CPU wrapper are unchanged.
Modelled: ``Ernie4_5_VLMoeForConditionalGeneration`` (``get_input_embeddings``, ``forward``, ``compute_logits``,
``_decoder_input_embeddings``), ``Ernie4_5_VLModel`` (``_cuda_graph_buffers``, ``prepare_vl_moe_meta``, ``forward``),
``Ernie4_5_VLDecoderLayer``, ``Ernie4_5_VLAttention``, ``Ernie4_5_VLMoE``, ``Ernie4_5_VLMLP``, ``VLMoEMeta``,
``text_image_index_out`` and ``text_image_gather_scatter`` (the XPU kernels), ``CudaGraphPiecewiseBackend``
(``__call__``, ``real_shape_to_captured_size``, ``concrete_size_entries``), ``ConcreteSizeEntry``, ``ForwardMeta``,
``XPUModelRunner`` (``capture_model``, ``_dummy_run``, ``execute_model``, ``padding_cudagraph_inputs``,
``real_token_num``).
Stand-ins: the kernels are written with tensor ops (a row-wise copy by number, a select of the two expert outputs laid
end to end, whose index past the end raises where the XPU reads past ``image_out``); the XPU scatter's writes past the
zero-row ``image_input`` slice land in the buffer there and nothing reads them, so they are left out. The text and
image MoE blocks are one SiLU MLP each (upstream's layers outside the MoE range use ``Ernie4_5_VLMLP`` too), plus one
shared MLP. Attention is one head over a KV cache of one row per request (a dummy row for padding and dummy runs),
written by ``index_put_`` at (request, position): a stand-in for the paged backends and their cleared decode buffers.
Paddle's ``copy_`` into ``_decoder_input_embeddings`` and ``token_type_ids`` gives the buffer the real rows over the
same memory; here the real rows are copied into its front and the graph reads its first S rows. ``capture_model``'s
dummy run is one decode step of S dummy tokens (id 5) on the dummy cache row (upstream: a dummy prefill, then decode).
``image_token_num`` and ``num_image_patch_id`` are host ints. The model: 2 layers of width 16, MLPs of 32, vocabulary
32 with image patch id 28 (the head scores the 28 text ids), float64, greedy sampling; capture sizes 1, 2, 4, one
warmup; the run without graphs is the same runner with ``use_cudagraph`` off. Linear layers sum row by row
(``linear``): a BLAS GEMM rounds a row differently with another row count, which a padded graph would show as
1e-15 differences that are no part of the bug.
Workload: four requests, A with three image patch tokens and their features (prompts of 6, 4, 5, 3 tokens; 4, 3, 5
and 6 new tokens), prefilled in one eager mixed step; decode steps of 4, 4, 3 (padded to 4), 2 and 1 requests.
Outputs: each step's logits and tokens, and the KV cache's request rows at the end.
Measured: the check printed
  fastdeploy_6049_xpu_gather_scatter_routes_graph_padding_rows_to_image_branch [bug] on cpu: misbehaves (raised
      IndexError: index out of range in self)
  fastdeploy_6049_xpu_gather_scatter_routes_graph_padding_rows_to_image_branch [fix] on cpu: equals eager (max |graph -
      eager| = 0)
The two decode steps of exactly 4 requests agree with the run without graphs in both variants; the bug raises at the
step of 3 requests padded to 4, in the first MoE layer's gather (``index_select`` past the laid-out expert outputs).
The whole check took about 3.7 s on the CPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/6049"
FAMILY = "under-sized buffers / shape contracts"
KIND = "padded-shape-mismatch"
SITE = "text_image_gather_scatter"
SYMPTOM = ("on XPU with CUDA graphs, ERNIE-4.5-VL's text_image_gather_scatter took the -1 token type of a padded "
           "decode step's padding rows for an image type and read their rows from the image expert's output past "
           "its end (it has only the step's real image rows)")

HIDDEN, FFN, LAYERS, VOCAB, TEXT_VOCAB, IM_PATCH_ID = 16, 32, 2, 32, 28, 28
MAX_SEQS, MAX_LEN, MAX_MODEL_LEN, DUMMY_TOKEN = 4, 16, 32, 5
CAPTURE_SIZES, WARMUPS = (1, 2, 4), 1
MAX_CAPTURE = max(CAPTURE_SIZES)
DUMMY_ROW = MAX_SEQS                     # the KV row of padding rows and dummy runs
DTYPE = torch.float64
_variant = "bug"


# --- the XPU kernels ------------------------------------------------------------------------------------------------

def text_image_index_out(token_type_ids: Tensor, text_index: Tensor, image_index: Tensor) -> None:
    """XPU kernel (unchanged by the fix): a row of type 0 gets the next text number, any other row the next image
    number; the rows of the other kind keep what the buffer held."""
    is_text = token_type_ids == 0
    text_count = torch.cumsum(is_text.to(torch.int32), 0, dtype=torch.int32) - 1
    image_count = torch.cumsum((~is_text).to(torch.int32), 0, dtype=torch.int32) - 1
    text_index.copy_(torch.where(is_text, text_count, text_index))
    image_index.copy_(torch.where(~is_text, image_count, image_index))


def _scatter_rows(dst: Tensor, src: Tensor, index: Tensor, rows: Tensor) -> None:
    """``dst[index[i]] = src[i]`` for the selected rows ``i``."""
    n = dst.shape[0]
    if n == 0:                           # a zero-row slice (XPU writes past it land in the buffer; nothing reads them)
        return
    hit = rows[None, :] & (index[None, :].to(torch.int64) == torch.arange(n, device=dst.device)[:, None])
    src_row = hit.to(torch.int64).argmax(1)
    dst.copy_(torch.where(hit.any(1)[:, None], src.index_select(0, src_row), dst))


def text_image_gather_scatter(input: Tensor, text_input: Tensor, image_input: Tensor, token_type_ids: Tensor,
                              text_index: Tensor, image_index: Tensor, is_scatter: bool):
    """The XPU kernel. ``is_scatter``: hidden rows into the text/image expert inputs; else the expert outputs back
    into the hidden rows. Returns ``(input, text_input, image_input)``, written in place."""
    is_text = token_type_ids == 0
    if _variant == "bug":
        is_image = token_type_ids != 0       # `else {  // token_type == 1`: the graph's -1 padding rows too
    else:
        is_image = token_type_ids == 1       # the fix: `else if (token_type == 1)`, any other type `continue`s
    if is_scatter:
        _scatter_rows(text_input, input, text_index, is_text)
        _scatter_rows(image_input, input, image_index, is_image)
        return input, text_input, image_input
    laid = torch.cat([text_input, image_input])          # the two outputs end to end: past image_out is past `laid`
    index = torch.where(is_text, text_index, torch.where(is_image, text_input.shape[0] + image_index, 0))
    picked = laid.index_select(0, index.to(torch.int64))
    input.copy_(torch.where((is_text | is_image)[:, None], picked, input))
    return input, text_input, image_input


# --- the model ------------------------------------------------------------------------------------------------------

def _w(gen, *shape, scale):
    return torch.randn(*shape, generator=gen, dtype=DTYPE) * scale


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` summed row by row (a BLAS GEMM rounds a row differently with another row count)."""
    return (x.unsqueeze(-1) * w).sum(-2)


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@dataclasses.dataclass
class ForwardMeta:
    ids_remove_padding: Tensor
    batch_id_per_token: Tensor           # KV row of each token
    positions: Tensor
    caches: Tensor                       # [layers, 2, MAX_SEQS + 1, MAX_LEN, HIDDEN]
    step_use_cudagraph: bool


@dataclasses.dataclass
class VLMoEMeta:
    text_input: Tensor
    image_input: Tensor
    text_index: Tensor
    image_index: Tensor
    token_type_ids: Tensor
    num_image_patch_id: int


class Ernie4_5_VLMLP:
    def __init__(self, gen, device):
        self.up = _w(gen, HIDDEN, FFN, scale=HIDDEN ** -0.5).to(device)
        self.down = _w(gen, FFN, HIDDEN, scale=FFN ** -0.5).to(device)

    def __call__(self, x: Tensor) -> Tensor:
        g = linear(x, self.up)
        return linear(g * torch.sigmoid(g), self.down)


class Ernie4_5_VLAttention:
    def __init__(self, gen, device, layer_id: int):
        self.layer_id = layer_id
        self.wq, self.wk, self.wv, self.wo = (_w(gen, HIDDEN, HIDDEN, scale=HIDDEN ** -0.5).to(device)
                                              for _ in range(4))

    def __call__(self, h: Tensor, forward_meta: ForwardMeta) -> Tensor:
        cache = forward_meta.caches[self.layer_id]
        rows, pos = forward_meta.batch_id_per_token, forward_meta.positions
        q, k, v = linear(h, self.wq), linear(h, self.wk), linear(h, self.wv)
        cache[0].index_put_((rows, pos), k)
        cache[1].index_put_((rows, pos), v)
        keys, values = cache[0][rows], cache[1][rows]                      # [tokens, MAX_LEN, HIDDEN]
        scores = (q[:, None, :] * keys).sum(-1) / math.sqrt(HIDDEN)
        later = torch.arange(MAX_LEN, device=h.device)[None, :] > pos[:, None]
        p = torch.softmax(scores.masked_fill(later, float("-inf")), -1)
        return linear((p[:, :, None] * values).sum(1), self.wo)


class Ernie4_5_VLMoE:
    def __init__(self, gen, device):
        self.shared_experts = Ernie4_5_VLMLP(gen, device)
        self.text_fused_moe = Ernie4_5_VLMLP(gen, device)
        self.image_fused_moe = Ernie4_5_VLMLP(gen, device)

    def __call__(self, hidden_states: Tensor, forward_meta: ForwardMeta, vl_moe_meta: VLMoEMeta) -> Tensor:
        shared_experts_out = self.shared_experts(hidden_states)
        hidden_states, text_input, image_input = text_image_gather_scatter(
            hidden_states, vl_moe_meta.text_input, vl_moe_meta.image_input, vl_moe_meta.token_type_ids,
            vl_moe_meta.text_index, vl_moe_meta.image_index, True)
        text_out = self.text_fused_moe(text_input)
        image_out = self.image_fused_moe(image_input)
        hidden_states, _, _ = text_image_gather_scatter(
            hidden_states, text_out, image_out, vl_moe_meta.token_type_ids,
            vl_moe_meta.text_index, vl_moe_meta.image_index, False)
        return hidden_states + shared_experts_out


class Ernie4_5_VLDecoderLayer:
    def __init__(self, gen, device, layer_id: int):
        self.input_layernorm = 1.0 + _w(gen, HIDDEN, scale=0.1).to(device)
        self.post_attention_layernorm = 1.0 + _w(gen, HIDDEN, scale=0.1).to(device)
        self.self_attn = Ernie4_5_VLAttention(gen, device, layer_id)
        self.mlp = Ernie4_5_VLMoE(gen, device)

    def __call__(self, forward_meta, hidden_states, residual, vl_moe_meta):
        residual = hidden_states if residual is None else hidden_states + residual
        hidden_states = self.self_attn(rms_norm(residual, self.input_layernorm), forward_meta)
        residual = hidden_states + residual
        hidden_states = self.mlp(rms_norm(residual, self.post_attention_layernorm), forward_meta, vl_moe_meta)
        return hidden_states, residual


class Ernie4_5_VLModel:
    def __init__(self, gen, device):
        self.embed_tokens = _w(gen, VOCAB, HIDDEN, scale=1.0).to(device)
        self.layers = [Ernie4_5_VLDecoderLayer(gen, device, i) for i in range(LAYERS)]
        self.norm = torch.ones(HIDDEN, dtype=DTYPE, device=device)
        # @cuda_graph_buffers: persistent buffers the captured kernels read and write
        self._cuda_graph_buffers = {
            "text_input": torch.ones(MAX_MODEL_LEN, HIDDEN, dtype=DTYPE, device=device),
            "image_input": torch.ones(MAX_MODEL_LEN, HIDDEN, dtype=DTYPE, device=device),
            "text_index": torch.zeros(MAX_MODEL_LEN, dtype=torch.int32, device=device),
            "image_index": torch.zeros(MAX_MODEL_LEN, dtype=torch.int32, device=device),
            "token_type_ids": torch.full((MAX_MODEL_LEN,), -1, dtype=torch.int32, device=device),
        }

    def prepare_vl_moe_meta(self, ids_remove_padding: Tensor) -> VLMoEMeta:
        image_mask = ids_remove_padding >= IM_PATCH_ID
        token_type_ids = image_mask.to(torch.int32)
        image_token_num = int(image_mask.sum())
        token_num = ids_remove_padding.shape[0]
        text_token_num = max(token_num - image_token_num, 1)
        num_image_patch_id = int((ids_remove_padding == IM_PATCH_ID).sum())
        buffers = self._cuda_graph_buffers
        # The scenario requiring padding is CUDA graph, thus we only need to pad the maximum capture size.
        buffers["token_type_ids"][:MAX_CAPTURE].fill_(-1)
        buffers["token_type_ids"][:token_num].copy_(token_type_ids)
        return VLMoEMeta(buffers["text_input"][:text_token_num], buffers["image_input"][:image_token_num],
                         buffers["text_index"][:token_num], buffers["image_index"][:token_num],
                         buffers["token_type_ids"][:token_num], num_image_patch_id)

    def forward(self, input_embeddings, ids_remove_padding, forward_meta, vl_moe_meta):
        text_image_index_out(vl_moe_meta.token_type_ids, vl_moe_meta.text_index, vl_moe_meta.image_index)
        hidden_states, residual = input_embeddings, None
        for layer in self.layers:
            hidden_states, residual = layer(forward_meta, hidden_states, residual, vl_moe_meta)
        return rms_norm(hidden_states + residual, self.norm)


@dataclasses.dataclass
class ConcreteSizeEntry:
    real_shape: int
    cuda_graph: object = None
    output_buffers: Tensor | None = None


class CudaGraphPiecewiseBackend:
    """What ``@support_graph_optimization`` puts around ``Ernie4_5_VLModel.forward``."""

    def __init__(self, runnable, device, static: dict, state: dict):
        self.runnable, self.device, self.static, self.state = runnable, device, static, state
        self.real_shape_to_captured_size = {n: min(s for s in CAPTURE_SIZES if s >= n)
                                            for n in range(1, MAX_CAPTURE + 1)}
        self.concrete_size_entries = {s: ConcreteSizeEntry(s) for s in CAPTURE_SIZES}
        self.unique_memory_pool_id = graph_pool_handle(device)

    def __call__(self, **kwargs):
        forward_meta = kwargs["forward_meta"]
        if not forward_meta.step_use_cudagraph:
            return self.runnable(**kwargs)
        real_shape = forward_meta.ids_remove_padding.shape[0]
        padding_real_shape = self.real_shape_to_captured_size[real_shape]
        entry = self.concrete_size_entries[padding_real_shape]
        if entry.cuda_graph is None:
            entry.cuda_graph, entry.output_buffers = capture(
                lambda: self.runnable(**kwargs), device=self.device, pool=self.unique_memory_pool_id,
                warmups=WARMUPS, name=f"size {padding_real_shape}", static=self.static, state=self.state,
                owner="XPUModelRunner")
        return replay(entry.cuda_graph, entry.output_buffers, real=real_shape, size=padding_real_shape,
                      padded={"input_embeddings": self.static["input_embeddings"]})


class Ernie4_5_VLMoeForConditionalGeneration:
    def __init__(self, device):
        gen = generator(6049)
        self.ernie = Ernie4_5_VLModel(gen, device)
        self.lm_head = _w(gen, HIDDEN, TEXT_VOCAB, scale=1.5).to(device)
        self._decoder_input_embeddings = torch.zeros(MAX_CAPTURE, HIDDEN, dtype=DTYPE, device=device)
        self.ernie_backend = self.ernie.forward         # replaced by the graph backend when graphs are on

    def get_input_embeddings(self, ids_remove_padding, image_token_num, image_features):
        input_embeddings = self.ernie.embed_tokens[ids_remove_padding]
        if image_token_num > 0:
            input_embeddings[ids_remove_padding == IM_PATCH_ID] = image_features
        return input_embeddings

    def forward(self, ids_remove_padding, image_features, forward_meta, padded_size):
        vl_moe_meta = self.ernie.prepare_vl_moe_meta(ids_remove_padding)
        input_embeddings = self.get_input_embeddings(ids_remove_padding, vl_moe_meta.num_image_patch_id,
                                                     image_features)
        if forward_meta.step_use_cudagraph:
            self._decoder_input_embeddings[:ids_remove_padding.shape[0]].copy_(input_embeddings)
            input_embeddings = self._decoder_input_embeddings[:padded_size]
        return self.ernie_backend(input_embeddings=input_embeddings, ids_remove_padding=ids_remove_padding,
                                  forward_meta=forward_meta, vl_moe_meta=vl_moe_meta)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return linear(hidden_states, self.lm_head)


# --- the runner -----------------------------------------------------------------------------------------------------

class XPUModelRunner:
    def __init__(self, device, use_cudagraph: bool):
        self.device, self.use_cudagraph = device, use_cudagraph
        self.model = Ernie4_5_VLMoeForConditionalGeneration(device)
        self.caches = torch.zeros(LAYERS, 2, MAX_SEQS + 1, MAX_LEN, HIDDEN, dtype=DTYPE, device=device)
        self.share_inputs = {"batch_id_per_token": torch.full((MAX_CAPTURE,), DUMMY_ROW, device=device),
                             "positions": torch.zeros(MAX_CAPTURE, dtype=torch.int64, device=device)}
        if use_cudagraph:
            static = {"input_embeddings": self.model._decoder_input_embeddings,
                      "token_type_ids": self.model.ernie._cuda_graph_buffers["token_type_ids"], **self.share_inputs}
            self.model.ernie_backend = CudaGraphPiecewiseBackend(self.model.ernie.forward, device, static,
                                                                 {"caches": self.caches})

    def padding_cudagraph_inputs(self, real: int, size: int) -> None:
        """Padding rows attend on the dummy KV row (a stand-in for the backends' cleared decode buffers)."""
        self.share_inputs["batch_id_per_token"][real:size].fill_(DUMMY_ROW)
        self.share_inputs["positions"][real:size].fill_(0)

    def execute_model(self, ids: list, rows: list, positions: list, only_decode: bool, image_features=None):
        dev = self.device
        ids_remove_padding = torch.tensor(ids).to(dev)
        real = len(ids)
        step_use_cudagraph = self.use_cudagraph and only_decode
        if step_use_cudagraph:
            size = min(s for s in CAPTURE_SIZES if s >= real)
            self.share_inputs["batch_id_per_token"][:real].copy_(torch.tensor(rows).to(dev))
            self.share_inputs["positions"][:real].copy_(torch.tensor(positions).to(dev))
            self.padding_cudagraph_inputs(real, size)
            forward_meta = ForwardMeta(ids_remove_padding, self.share_inputs["batch_id_per_token"][:size],
                                       self.share_inputs["positions"][:size], self.caches, True)
        else:
            size = real
            forward_meta = ForwardMeta(ids_remove_padding, torch.tensor(rows).to(dev), torch.tensor(positions).to(dev),
                                       self.caches, False)
        model_output = self.model.forward(ids_remove_padding, image_features, forward_meta, size)
        self.real_token_num = real
        return model_output[: self.real_token_num]

    def _dummy_run(self, batch_size: int) -> None:
        self.execute_model([DUMMY_TOKEN] * batch_size, [DUMMY_ROW] * batch_size, [0] * batch_size, only_decode=True)

    def capture_model(self) -> None:
        for batch_size in sorted(CAPTURE_SIZES, reverse=True):
            self._dummy_run(batch_size)


@dataclasses.dataclass
class Request:
    row: int
    prompt: list
    max_new: int
    tokens: list = dataclasses.field(default_factory=list)


def serve(device, use_cudagraph: bool) -> list:
    gen = generator(60490)
    image_features = (torch.randn(3, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
    runner = XPUModelRunner(device, use_cudagraph)
    if use_cudagraph:
        runner.capture_model()
    reqs = [Request(0, [3, IM_PATCH_ID, IM_PATCH_ID, IM_PATCH_ID, 11, 7], 4), Request(1, [9, 2, 14, 6], 3),
            Request(2, [21, 4, 4, 17, 1], 5), Request(3, [8, 25, 12], 6)]
    outputs = []

    def sample(logits: Tensor, batch: list) -> None:
        outputs.append(logits.clone())
        for req, tok in zip(batch, logits.argmax(-1).tolist()):
            req.tokens.append(tok)

    # prefill: one eager mixed step
    ids = [t for r in reqs for t in r.prompt]
    rows = [r.row for r in reqs for _ in r.prompt]
    positions = [p for r in reqs for p in range(len(r.prompt))]
    hidden = runner.execute_model(ids, rows, positions, only_decode=False, image_features=image_features)
    last = torch.tensor([sum(len(r.prompt) for r in reqs[:i + 1]) - 1 for i in range(len(reqs))]).to(device)
    sample(runner.model.compute_logits(hidden.index_select(0, last)), reqs)
    # decode
    while running := [r for r in reqs if len(r.tokens) < r.max_new]:
        hidden = runner.execute_model([r.tokens[-1] for r in running], [r.row for r in running],
                                      [len(r.prompt) + len(r.tokens) - 1 for r in running], only_decode=True)
        sample(runner.model.compute_logits(hidden), running)
    outputs.append(torch.tensor([t for r in reqs for t in r.tokens]))
    return outputs + [runner.caches[:, :, :MAX_SEQS].clone()]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cudagraph=True), lambda: serve(device, use_cudagraph=False))
