"""LightLLM Gemma-4 prefill CUDA graph: ``b_image_token_end`` is ``None`` for the text-only warmup batch the prefill graph is captured with, so the captured graph takes the text-only branches (no image bidirectional mask, no PLE masking of image tokens) and the replay's state copy skips the tensor; an image prefill served by the graph runs as plain text.

Upstream: https://github.com/ModelTC/LightLLM/commit/b4b13cc58656bd3a355de1fb37fa2f9f99eb930e ("fix attention cuda
graph", ModelTC/LightLLM, author WANDY666, committed 2026-05-13). Read: the commit's diff (``gemma4/infer_struct.py``
``_build_b_image_token_end``, ``gemma4/layer_infer/pre_layer_infer.py`` ``context_forward``,
``gemma4/layer_infer/transformer_layer_infer.py`` sliding-layer prefill attention, ``gemma4/model.py``), and at that
commit ``common/basemodel/prefill_cuda_graph.py`` (``_capture_prefill``, ``_replay``, ``find_closest_graph_handle_token_num``),
``InferStateInfo.copy_for_prefill_cuda_graph`` (copies a tensor only where the graph's state has one of the same
shape) and ``TpPartBaseModel._prefill``.
Symptom: Gemma-4 image prompts prefilled through the prefill CUDA graph get text-only attention on the sliding layers
and unmasked per-layer embeddings for image tokens: wrong answers about images, no error.
Mechanism: ``_build_b_image_token_end`` sets ``b_image_token_end = None`` when the batch carries no image; the layers
branch on ``getattr(infer_state, "b_image_token_end", None) is not None``. The prefill graph is captured at warmup with
a text-only dummy batch, so the captured kernels are the text branch; at replay ``copy_for_prefill_cuda_graph`` copies
only tensors the graph's state already holds, so the image step's ``b_image_token_end`` is dropped and the graph replays
causal sliding attention and unmasked PLE ids. Eager decides per step and takes the image branch.
Doctor: warmup-divergence, at _build_b_image_token_end. Capture decided a branch (tensor present or ``None``) from the
warmup batch that every replay reuses, while an eager step with an image decides otherwise.
Fix (upstream): ``_build_b_image_token_end`` always allocates a zero ``b_image_token_end`` of the token count (filled
for image spans), the pre-layer always masks with it and sliding layers always use the image-aware kernel, so the
graph reads a static tensor that the replay copy refreshes.
Modelled: ``Gemma4InferStateInfo._build_b_image_token_end`` (both versions), ``copy_for_prefill_cuda_graph``, the
pre-layer PLE masking and the sliding-layer branch, ``PrefillCudaGraph`` capture at warmup and replay by
``handle_token_num``. Stand-ins: one sliding layer, a torch mask instead of the Triton ``context_attention_fwd_gemma4_mm``
kernel, one request per prefill of exactly a captured size (no padding), float64, the whole forward captured as one
graph instead of piecewise segments.
Workload: graph for 8 tokens captured with a text-only warmup. Step 1: text-only prompt of 8 tokens. Step 2: 8 tokens
with an image span at tokens 2..5. Bug: step 1 equals eager (0), step 2 differs: max |graph - eager| = 50.9
Fix: equals eager (max 0).
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ModelTC/LightLLM/commit/b4b13cc58656bd3a355de1fb37fa2f9f99eb930e"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "_build_b_image_token_end"
SYMPTOM = ("Gemma-4 image prefills served by the prefill CUDA graph run the text-only branch captured at warmup: "
           "no image bidirectional attention, unmasked per-layer embeddings")

VOCAB, HIDDEN, PLE_DIM, SLIDING_WINDOW = 16, 8, 4, 6
PAD_TOKEN_ID, IMAGE_TOKEN_ID = 0, 15
GRAPH_HANDLE_TOKEN_NUMS = [8]
DTYPE = torch.float64

_variant = "bug"


class Gemma4InferStateInfo:
    def __init__(self, input_ids, multimodal_params):
        self.input_ids = input_ids
        self.position_ids = torch.arange(input_ids.shape[0], device=input_ids.device)
        self.multimodal_params = multimodal_params
        self.total_token_num, self.prefix_total_token_num = input_ids.shape[0], 0

    def _build_b_image_token_end(self):
        if _variant == "fix":
            device = self.position_ids.device
            self.b_image_token_end = torch.zeros(self.position_ids.shape[0], dtype=torch.int32, device=device)
        if not self.multimodal_params:
            if _variant == "bug":
                self.b_image_token_end = None
            return
        if _variant == "bug":
            device = self.position_ids.device
            self.b_image_token_end = torch.zeros(self.position_ids.shape[0], dtype=torch.int32, device=device)
        for img in self.multimodal_params:                         # build_b_image_token_end (Triton) as a fill
            start, length = img["start_idx"], img["len"]
            self.b_image_token_end[start:start + length] = start + length

    def init_some_extra_state(self):
        self._build_b_image_token_end()

    def copy_for_prefill_cuda_graph(self, new_infer_state):
        for attr_name, attr_value in vars(new_infer_state).items():
            if isinstance(attr_value, torch.Tensor):
                attr_ = getattr(self, attr_name, None)
                if attr_ is not None and attr_.data_ptr() != attr_value.data_ptr() and attr_.shape == attr_value.shape:
                    attr_.copy_(attr_value)


class Gemma4Layers:
    def __init__(self, device):
        gen = generator(4413)
        r = lambda *s: randn(*s, gen=gen, device=device).to(DTYPE)  # noqa: E731
        self.embed, self.ple_embed, self.ple_proj = r(VOCAB, HIDDEN), r(VOCAB, PLE_DIM), r(PLE_DIM, HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) * 0.5 for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB)

    # gemma4/layer_infer/pre_layer_infer.py
    def context_forward(self, input_ids, infer_state):
        input_embdings = self.embed[input_ids]
        if _variant == "bug":
            image_token_end = getattr(infer_state, "b_image_token_end", None)
            input_ids_for_ple = (input_ids if image_token_end is None
                                 else input_ids.masked_fill(image_token_end != 0, PAD_TOKEN_ID))
        else:
            input_ids_for_ple = input_ids.masked_fill(infer_state.b_image_token_end != 0, PAD_TOKEN_ID)
        return input_embdings + self.ple_embed[input_ids_for_ple] @ self.ple_proj   # _compute_per_layer_embeds

    # gemma4/layer_infer/transformer_layer_infer.py (one sliding layer)
    def _context_attention_kernel(self, x, infer_state):
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        i = infer_state.position_ids[:, None]
        j = infer_state.position_ids[None, :]
        causal_swa = (j <= i) & (i - j < SLIDING_WINDOW)
        if _variant == "bug" and getattr(infer_state, "b_image_token_end", None) is None:
            mask = causal_swa                                          # secondary backend: causal SWA only
        else:                                                          # context_attention_fwd_gemma4_mm
            end = infer_state.b_image_token_end.long()[:, None]
            mask = causal_swa | ((end != 0) & (j < end) & (j >= i - SLIDING_WINDOW + 1))
        scores = (q @ k.T) / HIDDEN ** 0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return (probs @ v) @ self.wo

    def forward(self, input_ids, infer_state):
        h = self.context_forward(input_ids, infer_state)
        h = h + self._context_attention_kernel(h, infer_state)
        return h @ self.lm_head


class PrefillCudaGraph:
    def __init__(self, device):
        self.device, self.graph = device, {}
        self.graph_handle_token_nums = GRAPH_HANDLE_TOKEN_NUMS

    def find_closest_graph_handle_token_num(self, handle_token_num):
        return next((n for n in self.graph_handle_token_nums if n >= handle_token_num), None)

    def _capture_prefill(self, prefill_func, input_ids, infer_state):
        handle_token_num = infer_state.total_token_num - infer_state.prefix_total_token_num
        graph_input_ids = input_ids.clone()
        static = {"input_ids": graph_input_ids, "position_ids": infer_state.position_ids}
        if getattr(infer_state, "b_image_token_end", None) is not None:
            static["b_image_token_end"] = infer_state.b_image_token_end
        g, out = capture(lambda: prefill_func(graph_input_ids, infer_state), device=self.device,
                         name=f"prefill [{handle_token_num}]", owner="PrefillCudaGraph", static=static)
        self.graph[handle_token_num] = (infer_state, graph_input_ids, g, out)

    def _replay(self, input_ids, infer_state):
        handle_token_num = infer_state.total_token_num - infer_state.prefix_total_token_num
        graph_infer_state, graph_input_ids, g, out = self.graph[handle_token_num]
        graph_input_ids.copy_(input_ids)
        graph_infer_state.copy_for_prefill_cuda_graph(new_infer_state=infer_state)
        return replay(g, out)


class TpPartBaseModel:
    def __init__(self, device, use_prefill_graph):
        self.device, self.layers = device, Gemma4Layers(device)
        self.prefill_graph = PrefillCudaGraph(device) if use_prefill_graph else None
        if self.prefill_graph is not None:                               # warmup: text-only dummy prefill
            for n in GRAPH_HANDLE_TOKEN_NUMS:
                dummy = Gemma4InferStateInfo(torch.ones(n, dtype=torch.long, device=device), None)
                dummy.init_some_extra_state()
                self.prefill_graph._capture_prefill(self.layers.forward, dummy.input_ids, dummy)

    def _prefill(self, input_ids, multimodal_params):
        infer_state = Gemma4InferStateInfo(input_ids.to(self.device), multimodal_params)
        infer_state.init_some_extra_state()
        n = infer_state.total_token_num
        if self.prefill_graph is not None and self.prefill_graph.find_closest_graph_handle_token_num(n) == n:
            return self.prefill_graph._replay(infer_state.input_ids, infer_state).clone()
        return self.layers.forward(infer_state.input_ids, infer_state)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    text = torch.tensor([3, 7, 1, 9, 4, 12, 2, 5])
    image = torch.tensor([3, 7, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 2, 5])
    steps = [(text, None), (image, [{"start_idx": 2, "len": 4}])]

    def serve(use_prefill_graph):
        model = TpPartBaseModel(device, use_prefill_graph)
        return [model._prefill(ids, mm) for ids, mm in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
