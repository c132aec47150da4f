"""The ViT encoder graph's output buffer is kept only through a weak reference after capture.

Upstream: https://github.com/vllm-project/vllm-ascend/pull/16794 ("[BugFix][Worker] Fix ViT ACL graph
capture/replay failures on GLM5.3-flash").
Symptom: with ``cudagraph_mm_encoder`` (ViT encoder ACL graphs), encoder graph replay crashes with ``507011``
(invalid address), GLM-5.3-Flash TP16 on Ascend 910_93 (vllm-ascend, Sep 2026).
Mechanism: ``EncoderAclGraphManager._capture_budget_graph`` allocates ``output_buffer`` with
``torch.empty_like`` outside the graph (ordinary allocator memory, not the graph pool) and records
``output_buffer.copy_(output)`` in the budget's graph. It then keeps only ``weak_ref_tensors(output_buffer)``
in the budget's ``BudgetGraphMetadata``, so nothing owns the buffer once the capture function returns and
the allocator takes the memory back and hands it on. Every replay still writes the encoder output to that
baked address, and the manager hands out a view of it.
Doctor: dangling-reference, at ``_capture_budget_graph`` (the output buffer released after capture while the
graph keeps its address).
Fix (upstream): keep a strong reference to ``output_buffer`` in the graph metadata, as vLLM's
``EncoderCudaGraphManager`` does (and stop weak-referencing the attention workspaces).
"""
from __future__ import annotations

import weakref

import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm-ascend/pull/16794"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_capture_budget_graph"
SYMPTOM = "encoder graph replay writes to a freed output buffer (507011 invalid address on the NPU)"
PATCH, DIM, OUT = 6, 4, 5                  # patch features, hidden size, merged embedding size
TOKEN_BUDGETS = [8, 16]
MAX_BATCH_SIZE = 2                         # images per encoder graph replay


class WeakRefTensor:
    """``vllm_ascend.utils.weak_ref_tensors``: a handle on a tensor's memory that does not own it. While the
    owner lives it is that tensor; once the owner lets go, the handle points at released memory."""

    def __init__(self, t: torch.Tensor):
        self._ref = weakref.ref(t)

    def resolve(self) -> torch.Tensor | None:
        return self._ref()


def weak_ref_tensors(t: torch.Tensor) -> WeakRefTensor:
    return WeakRefTensor(t)


def _resolve(t):
    return t.resolve() if isinstance(t, WeakRefTensor) else t


class BudgetGraphMetadata:
    """vLLM's per-budget graph record: the graph, its input buffers and the output it hands out."""

    def __init__(self, token_budget, max_batch_size, graph, input_buffers, output_buffer):
        self.token_budget, self.max_batch_size = token_budget, max_batch_size
        self.graph, self.input_buffers, self.output_buffer = graph, input_buffers, output_buffer


class VisionEncoder:
    """A ViT block: patch embedding, attention within each image (``cu_seqlens``), merger projection."""

    def __init__(self, device):
        gen = generator(16794)
        self.device = device
        self.patch_embed = randn(PATCH, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.merger = randn(DIM, OUT, gen=gen, device=device, scale=0.5)

    def encoder_cudagraph_forward(self, values):
        x = values["pixel_values"] @ self.patch_embed
        cu = values["cu_seqlens"]
        tok = torch.arange(x.shape[0], device=x.device)
        segment = torch.searchsorted(cu[1:].contiguous(), tok, right=True)     # image of each token
        same = segment[:, None] == segment[None, :]
        scores = ((x @ self.wq) @ (x @ self.wk).T / DIM ** 0.5).masked_fill(~same, float("-inf"))
        return (x + torch.softmax(scores, -1) @ (x @ self.wv)) @ self.merger

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, max_batch_size):
        cu = torch.linspace(0, token_budget, max_batch_size + 1, device=self.device).long()
        return {"pixel_values": torch.zeros(token_budget, PATCH, device=self.device), "cu_seqlens": cu}

    def prepare_encoder_cudagraph_replay_buffers(self, images):
        lengths = torch.tensor([0] + [img.shape[0] for img in images], device=self.device)
        return {"pixel_values": torch.cat(images), "cu_seqlens": torch.cumsum(lengths, 0)}

    def forward_eager(self, image):
        cu = torch.tensor([0, image.shape[0]], device=self.device)
        return self.encoder_cudagraph_forward({"pixel_values": image, "cu_seqlens": cu})


class EncoderAclGraphManager:
    def __init__(self, model, device, variant):
        self.model, self.device, self.variant = model, device, variant
        self.graph_pool = graph_pool_handle(device)
        self.budget_graphs: dict[int, BudgetGraphMetadata] = {}

    def capture(self):
        for token_budget in TOKEN_BUDGETS:
            self._capture_budget_graph(token_budget)

    def _capture_budget_graph(self, token_budget):
        values = self.model.prepare_encoder_cudagraph_capture_inputs(token_budget, MAX_BATCH_SIZE)
        with events.warmup():
            output = self.model.encoder_cudagraph_forward(dict(values))
        output_buffer = torch.empty_like(output)                  # outside the graph: not graph-pool memory
        graph_meta = BudgetGraphMetadata(token_budget, MAX_BATCH_SIZE, None, values, None)
        graph_meta.output_buffer = weak_ref_tensors(output_buffer) if self.variant == "bug" else output_buffer

        def encoder_graph_step():
            out = self.model.encoder_cudagraph_forward(dict(graph_meta.input_buffers))
            _resolve(graph_meta.output_buffer).copy_(out)
            return out

        graph_meta.graph, _ = capture(encoder_graph_step, device=self.device, pool=self.graph_pool, warmups=0,
                                      name=f"encoder budget {token_budget}", static=values,
                                      owner="EncoderAclGraphManager")
        self.budget_graphs[token_budget] = graph_meta

    @staticmethod
    def _copy_padded_buffer(buf, src):
        buf[: src.shape[0]].copy_(src)
        buf[src.shape[0]:].zero_()

    def _copy_cu_seqlens(self, buf, src):
        buf[: src.shape[0]].copy_(src)
        buf[src.shape[0]:].fill_(src[-1])

    def _run_budget_graph(self, images, token_budget):
        graph_meta = self.budget_graphs[token_budget]
        replay_values = self.model.prepare_encoder_cudagraph_replay_buffers(images)
        self._copy_padded_buffer(graph_meta.input_buffers["pixel_values"], replay_values["pixel_values"])
        self._copy_cu_seqlens(graph_meta.input_buffers["cu_seqlens"], replay_values["cu_seqlens"])
        num_tokens = replay_values["pixel_values"].shape[0]
        return replay(graph_meta.graph, _resolve(graph_meta.output_buffer), real=num_tokens, size=token_budget)

    def execute(self, images):
        """Encode a batch of images with the smallest budget graph that holds them; one embedding per image."""
        num_tokens = sum(img.shape[0] for img in images)
        token_budget = next(b for b in TOKEN_BUDGETS if b >= num_tokens)
        output = self._run_budget_graph(images, token_budget)
        embeds, start = [], 0
        for img in images:
            embeds.append(output[start:start + img.shape[0]].clone())   # into the encoder cache
            start += img.shape[0]
        return embeds


def run(variant: str, device: str = "cpu"):
    gen = generator(1679)
    batches = [[randn(3, PATCH, gen=gen, device=device), randn(4, PATCH, gen=gen, device=device)],
               [randn(11, PATCH, gen=gen, device=device)],
               [randn(5, PATCH, gen=gen, device=device)]]

    def served():
        manager = EncoderAclGraphManager(VisionEncoder(device), device, variant)
        with torch.no_grad():
            manager.capture()
            return [e for images in batches for e in manager.execute(images)]

    def eager():
        model = VisionEncoder(device)
        with torch.no_grad():
            return [model.forward_eager(img) for images in batches for img in images]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
