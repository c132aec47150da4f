"""A weight reload from disk rebuilds gpt-oss's swizzled MXFP4 expert tensors; the decode graphs keep the freed ones.

Upstream: https://github.com/sgl-project/sglang/pull/12060 ("Conditionally recapture cuda graph after model
weight update from disk"); issue https://github.com/sgl-project/sglang/issues/11289 ("update_weights_from_disk()
results in a fatal server crash for gpt-oss"); first fix #11780, reverted in #11980.
Symptom: on gpt-oss (MXFP4 MoE through triton_kernels) with CUDA graphs on, calling
``/update_weights_from_disk`` succeeds, and the next decode batch kills the scheduler with ``CUDA error: an
illegal memory access``; with ``--disable-cuda-graph`` the same update works (sglang main, Oct 2025).
Mechanism: ``Mxfp4MoEMethod.process_weights_after_loading`` does not keep the checkpoint parameters: it
builds new, swizzled expert tensors (``w13_weight_triton_tensor`` / ``w2_weight_triton_tensor``), keeps them
on the quant method and deletes ``layer.w13_weight`` / ``layer.w2_weight``. The decode CUDA graphs were
captured reading those swizzled tensors. ``update_weights_from_disk`` runs the loader again
(``load_weights_and_postprocess``): the checkpoint parameters are materialised again and
``process_weights_after_loading`` binds *new* swizzled tensors, releasing the old ones. Nothing recaptures
the graphs, so every replay reads expert weights whose owner has released them: freed memory (an illegal
memory access once the allocator gives it back, stale or foreign data before that). Eager decode looks the
attributes up again each step and uses the new weights. Models whose weights are updated in place
(``param.data.copy_``) are not affected, which is why the endpoint's tests passed.
Doctor: dangling-reference, at ``process_weights_after_loading`` (it rebinds, and so releases, the tensors
the captured MoE kernels read).
Fix (upstream): ``update_weights_from_disk(..., recapture_cuda_graph=...)``: when the request sets
``recapture_cuda_graph`` the model runner calls ``init_device_graphs()`` after the load, so the graphs are
captured again against the new tensors (#11780 did it unconditionally and was reverted; #12060 made it a
request flag).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/12060"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "process_weights_after_loading"
SYMPTOM = "illegal memory access at the first decode after update_weights_from_disk on gpt-oss with CUDA graphs"
VOCAB, HIDDEN, INTERMEDIATE, NUM_EXPERTS, BS = 12, 6, 4, 2, 2


def _swizzle_mxfp4(weight, scale):
    """triton_kernels' swizzle: a new tensor in the kernel's layout (dequantised here)."""
    return (weight * scale[..., None]).transpose(-1, -2).contiguous()


class Mxfp4MoEMethod:
    def create_weights(self, layer):
        layer.w13_weight = torch.zeros(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device=layer.device)
        layer.w13_weight_scale = torch.ones(NUM_EXPERTS, 2 * INTERMEDIATE, device=layer.device)
        layer.w2_weight = torch.zeros(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device=layer.device)
        layer.w2_weight_scale = torch.ones(NUM_EXPERTS, HIDDEN, device=layer.device)

    def process_weights_after_loading(self, layer):
        w13_weight = _swizzle_mxfp4(layer.w13_weight, layer.w13_weight_scale)
        w2_weight = _swizzle_mxfp4(layer.w2_weight, layer.w2_weight_scale)
        self.w13_weight_triton_tensor = w13_weight        # rebinding releases the previous load's tensors
        self.w2_weight_triton_tensor = w2_weight
        del layer.w13_weight
        del layer.w2_weight

    def apply(self, layer, x, router_logits):
        """triton_kernel_moe_forward: softmax routing over the experts (top-k = all, tiny)."""
        topk_weights = torch.softmax(router_logits, dim=-1)
        h13 = torch.einsum("th,ehn->etn", x, self.w13_weight_triton_tensor)
        gate, up = h13.chunk(2, dim=-1)
        h2 = torch.einsum("etn,enh->eth", torch.nn.functional.silu(gate) * up, self.w2_weight_triton_tensor)
        return torch.einsum("te,eth->th", topk_weights, h2)


class FusedMoE:
    def __init__(self, device):
        self.device = device
        self.quant_method = Mxfp4MoEMethod()
        self.quant_method.create_weights(self)

    def weight_loader(self, name, loaded_weight):
        if not hasattr(self, name):                       # deleted by the previous post-processing
            self.quant_method.create_weights(self)
        getattr(self, name).copy_(loaded_weight)

    def forward(self, x, router_logits):
        return self.quant_method.apply(self, x, router_logits)


class GptOssForCausalLM:
    def __init__(self, device):
        gen = generator(12060)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.router = randn(HIDDEN, NUM_EXPERTS, gen=gen, device=device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.experts = FusedMoE(device)

    def load_weights(self, weights):
        for name, loaded_weight in weights:
            self.experts.weight_loader(name, loaded_weight)

    def forward(self, input_ids):
        h = self.embed_tokens[input_ids]
        h = h + self.experts.forward(h, h @ self.router)
        return h @ self.lm_head


def checkpoint(seed, device):
    """The expert tensors of one checkpoint on disk (model_path -> weights)."""
    gen = generator(seed)
    return [("w13_weight", randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, gen=gen, device=device, scale=0.5)),
            ("w2_weight", randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, gen=gen, device=device, scale=0.5))]


class DefaultModelLoader:
    def __init__(self, disk):
        self.disk = disk

    def load_weights_and_postprocess(self, model, model_path):
        model.load_weights(iter(self.disk[model_path]))
        model.experts.quant_method.process_weights_after_loading(model.experts)


class ModelRunner:
    def __init__(self, model, loader, device, use_cuda_graph: bool):
        self.model, self.loader, self.device = model, loader, device
        self.use_cuda_graph = use_cuda_graph
        self.input_ids = torch.zeros(BS, dtype=torch.long, device=device)
        self.graph = self.output = None
        if use_cuda_graph:
            self.init_device_graphs()

    def init_device_graphs(self):
        """CudaGraphRunner: capture the decode step of the current model."""
        self.graph, self.output = capture(lambda: self.model.forward(self.input_ids), device=self.device,
                                          static={"input_ids": self.input_ids}, owner="CudaGraphRunner (decode)")

    def forward_decode(self, ids):
        if not self.use_cuda_graph:
            return self.model.forward(ids).clone()
        self.input_ids.copy_(ids)
        return replay(self.graph, self.output).clone()

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph: bool = False):
        """Update engine weights in-place from the disk."""
        self.loader.load_weights_and_postprocess(self.model, model_path)
        if recapture_cuda_graph and self.use_cuda_graph:
            self.init_device_graphs()
        return True, "Succeeded to update model weights."


def run(variant: str, device: str = "cpu"):
    disk = {"gpt-oss-20b": checkpoint(1, device), "gpt-oss-20b-step1": checkpoint(2, device)}
    steps = [[1, 2], [3, 4], [5, 6], [7, 8]]

    def serve(use_cuda_graph: bool):
        model = GptOssForCausalLM(device)
        loader = DefaultModelLoader(disk)
        loader.load_weights_and_postprocess(model, "gpt-oss-20b")
        runner = ModelRunner(model, loader, device, use_cuda_graph)
        outs = [runner.forward_decode(torch.tensor(ids, device=device)) for ids in steps[:2]]
        # RL rollout: the trainer publishes new weights; UpdateWeightFromDiskReqInput.recapture_cuda_graph
        # defaults to False (the bug's only path before #11780/#12060).
        runner.update_weights_from_disk("gpt-oss-20b-step1", "auto", recapture_cuda_graph=(variant == "fix"))
        outs += [runner.forward_decode(torch.tensor(ids, device=device)) for ids in steps[2:]]
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
