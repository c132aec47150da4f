"""LongRoPE reassigns its cos/sin cache in forward; compiled and graphed, the module keeps a weak ref, the cache dies.

Upstream: https://github.com/vllm-project/vllm/pull/11596 ("[v1][bugfix] fix cudagraph with inplace buffer
assignment").
Symptom: V1 with ``microsoft/Phi-3.5-vision-instruct`` (torch.compile + piecewise CUDA graphs) silently
generates garbage after the first steps ("super-complicated bug", found by the maintainers with the
MMMU benchmark); it appeared only with this model (vLLM 0.6.6, December 2024).
Mechanism: ``Phi3LongRoPEScaledRotaryEmbedding.forward`` runs ``self.long_short_cos_sin_cache =
self.long_short_cos_sin_cache.to(idx.device)``, a no-op in eager mode. Dynamo turns the attribute
assignment into a graph output and its bytecode into ``self._buffers.update({'long_short_cos_sin_cache':
graph_out_0[1]})`` after every call of the compiled graph (the dump in the PR). vLLM's piecewise backend
hands back, on every replay, ``weak_ref_tensors`` of the outputs it kept at capture: tensors that do not
own their memory. That output is the cache itself, so after the first replay the module's only owning
reference to the cache is replaced by a non-owning one and the cache is freed. The captured
``index_select`` keeps reading its address; the caching allocator hands the block to the next
allocation of that size (here the vision tower's patch features of the next image request), and the
rotary embedding reads those as cos/sin.
Doctor: dangling-reference, at ``forward`` (``Phi3LongRoPEScaledRotaryEmbedding.forward``: the buffer
reassignment that, once compiled, replaces the cache's owner by the graph's non-owning output).
Fix (upstream): drop the reassignment (the cache is created on the right device in ``__init__``), so
the compiled graph has no buffer output and the module keeps owning the cache; a later comment in the
PR shows vLLM's compilation wrapper now raising on bytecode that updates ``_buffers`` (not modelled).
Read: the PR description, its Dynamo dump and comments, not the diff. That the freed memory is the
cache (the graph output aliases the buffer, and ``weak_ref_tensors`` keeps no owner) is this program's
reading of vLLM 0.6.6's ``PiecewiseBackend``, not a statement of the PR.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import IllegalMemoryAccess, reuse_freed_blocks
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/11596"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "forward"
SYMPTOM = "Phi-3.5-vision decodes garbage under V1 CUDA graphs: the LongRoPE cos/sin cache was freed"

VOCAB, HIDDEN = 16, 4                        # one head, head_size = rotary_dim = HIDDEN
ORIGINAL_MAX_POSITION, MAX_POSITION = 8, 24  # short cache rows, long cache rows
NUM_PATCHES, CLIP_DIM, PATCH_DIM = 4, 32, 3  # patch features [4, 32] fp32: as many bytes as the cache
IMAGE_TOKEN = VOCAB                          # placeholder id (outside the text vocabulary)
CAPTURE_SIZES = [4, 8, 16]


def _rotate_neox(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _compute_cos_sin_cache(max_position, rescale_factors, mscale, device):
    inv_freq = 1.0 / (rescale_factors * 10000.0 ** (torch.arange(0, HIDDEN, 2, dtype=torch.float) / HIDDEN))
    freqs = torch.einsum("i,j->ij", torch.arange(max_position, dtype=torch.float), inv_freq)
    return (torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)).to(device)


class Phi3LongRoPEScaledRotaryEmbedding(torch.nn.Module):
    def __init__(self, variant: str, device):
        super().__init__()
        self.variant = variant
        self.rotary_dim = HIDDEN
        self.original_max_position_embeddings = ORIGINAL_MAX_POSITION
        short_cache = _compute_cos_sin_cache(ORIGINAL_MAX_POSITION, torch.tensor([1.0, 1.5]), 1.0, device)
        long_cache = _compute_cos_sin_cache(MAX_POSITION, torch.tensor([2.0, 6.0]), 1.2, device)
        self.register_buffer("long_short_cos_sin_cache", torch.cat([short_cache, long_cache], dim=0),
                             persistent=False)

    def forward(self, positions, query, key):
        k = self.original_max_position_embeddings
        long_prompt_offset = (torch.any(positions > k).float() * torch.full_like(positions, k)).long()
        idx = torch.add(positions, long_prompt_offset)
        if self.variant == "bug":
            self.long_short_cos_sin_cache = self.long_short_cos_sin_cache.to(idx.device)
        cos_sin = torch.index_select(self.long_short_cos_sin_cache, 0, idx)
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos, sin = cos.repeat(1, 2), sin.repeat(1, 2)
        return query * cos + _rotate_neox(query) * sin, key * cos + _rotate_neox(key) * sin


class Phi3VForCausalLM:
    def __init__(self, variant: str, device):
        gen = generator(11596)
        self.variant = variant
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.w_clip = randn(PATCH_DIM, CLIP_DIM, gen=gen, device=device, scale=0.5)     # img_processor
        self.img_projection = randn(CLIP_DIM, HIDDEN, gen=gen, device=device, scale=0.3)
        self.wq, self.wk, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.6) for _ in range(3))
        self.rotary_emb = Phi3LongRoPEScaledRotaryEmbedding(variant, device)

    def get_multimodal_embeddings(self, pixel_values):
        patch_features = pixel_values @ self.w_clip            # [NUM_PATCHES, CLIP_DIM]: the CLIP output
        return patch_features @ self.img_projection

    def get_input_embeddings(self, input_ids, image_embeds):
        is_image = input_ids == IMAGE_TOKEN
        embeds = self.embed_tokens[input_ids.clamp(max=VOCAB - 1)]
        if image_embeds is not None:
            embeds[is_image] = image_embeds
        return embeds

    def compiled_graph(self, inputs_embeds, positions):
        """What Dynamo traced of the decoder: its outputs are the hidden states and, in the bug, the
        rotary module's reassigned buffer (an attribute mutation becomes a graph output)."""
        q, k = self.rotary_emb(positions, inputs_embeds @ self.wq, inputs_embeds @ self.wk)
        hidden_states = inputs_embeds + (q * k) @ self.wo
        if self.variant == "bug":
            return hidden_states, self.rotary_emb.long_short_cos_sin_cache
        return (hidden_states,)


class WeakRefTensor:
    """vLLM's ``weak_ref_tensor``: the same memory, without owning it. (Outputs the graph's pool owns
    stay valid as long as the graph does, so the emulation keeps those as tensors and uses this handle
    for an output that aliases memory someone else owns.)"""

    def __init__(self, t: torch.Tensor):
        self.weak = StorageWeakRef(t.untyped_storage())
        self.dtype, self.shape, self.stride_, self.offset = t.dtype, tuple(t.shape), t.stride(), t.storage_offset()

    def to(self, device):
        if self.weak.expired():
            raise IllegalMemoryAccess("a weak_ref_tensor outlived the tensor that owned its memory")
        storage = torch.UntypedStorage._new_with_weak_ptr(self.weak.cdata)
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, self.offset, self.shape, self.stride_)


def weak_ref_tensors(outputs, owned_elsewhere):
    keys = {t.untyped_storage()._cdata for t in owned_elsewhere}
    return tuple(WeakRefTensor(t) if t.untyped_storage()._cdata in keys else t for t in outputs)


@dataclasses.dataclass
class ConcreteSizeEntry:
    graph: object = None
    output: tuple = ()


class PiecewiseBackend:
    """One graph per capture size: captured on first use (after a warmup), then replayed; every call
    after the capture returns the weak references kept at capture (``entry.output``)."""

    def __init__(self, model: Phi3VForCausalLM, runner: GPUModelRunner, device):
        self.model, self.runner, self.device = model, runner, device
        self.entries = {size: ConcreteSizeEntry() for size in CAPTURE_SIZES}

    def __call__(self, inputs_embeds, positions):
        size = inputs_embeds.shape[0]
        entry = self.entries.get(size)
        if entry is None:
            return self.model.compiled_graph(inputs_embeds, positions)
        if entry.graph is None:
            lifted = [self.model.rotary_emb.long_short_cos_sin_cache]      # module buffers: graph inputs
            entry.graph, output = capture(
                lambda: self.model.compiled_graph(inputs_embeds, positions), device=self.device,
                on_freed="reuse", owner="PiecewiseBackend (Phi3V decoder)", name=f"size {size}",
                static={"inputs_embeds": self.runner.inputs_embeds, "positions": self.runner.positions})
            entry.output = weak_ref_tensors(output, lifted)
            return output
        real = self.runner.num_scheduled_tokens
        hidden_states = replay(entry.graph, entry.output[0], real=real, size=size,
                               padded={"inputs_embeds": self.runner.inputs_embeds,
                                       "positions": self.runner.positions})
        return (hidden_states, *entry.output[1:])


def transformed_code_for_forward(model: Phi3VForCausalLM, compiled_fn, inputs_embeds, positions):
    """Dynamo's bytecode around the compiled graph (``__transformed_code_0_for_forward``)."""
    graph_out = compiled_fn(inputs_embeds, positions)
    if len(graph_out) > 1:
        model.rotary_emb._buffers.update({"long_short_cos_sin_cache": graph_out[1]})
    return graph_out[0]


class GPUModelRunner:
    def __init__(self, variant: str, device, graphed: bool):
        self.device = device
        self.model = Phi3VForCausalLM(variant, device)
        self.inputs_embeds = torch.zeros(CAPTURE_SIZES[-1], HIDDEN, device=device)
        self.positions = torch.zeros(CAPTURE_SIZES[-1], dtype=torch.long, device=device)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_scheduled_tokens = 0
        self.compiled_fn = PiecewiseBackend(self.model, self, device) if graphed else self.model.compiled_graph

    def _execute_encoder(self, req_id: str, pixel_values):
        self.encoder_cache[req_id] = self.model.get_multimodal_embeddings(pixel_values)

    def execute_model(self, tokens):
        """``tokens``: (request id, token id, position) per scheduled token; the placeholder token at
        position ``p`` of a request takes row ``p`` of its image embeddings."""
        n = self.num_scheduled_tokens = len(tokens)
        num_input_tokens = next(s for s in CAPTURE_SIZES if s >= n)        # pad_for_cudagraph
        ids = torch.tensor([t for _, t, _ in tokens], device=self.device)
        image_rows = [self.encoder_cache[r][p] for r, t, p in tokens if t == IMAGE_TOKEN]
        image_embeds = torch.stack(image_rows) if image_rows else None
        self.inputs_embeds[:n].copy_(self.model.get_input_embeddings(ids, image_embeds))
        self.positions[:n].copy_(torch.tensor([p for _, _, p in tokens], device=self.device))
        hidden_states = transformed_code_for_forward(self.model, self.compiled_fn,
                                                     self.inputs_embeds[:num_input_tokens],
                                                     self.positions[:num_input_tokens])
        return hidden_states[:n].clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(7)
    pixels = {r: randn(NUM_PATCHES, PATCH_DIM, gen=gen, device=device) for r in ("a", "b", "c")}

    def prompt(req, text):                  # image placeholders, then text
        return [(req, IMAGE_TOKEN, p) for p in range(NUM_PATCHES)] + \
               [(req, t, NUM_PATCHES + i) for i, t in enumerate(text)]

    def serve(graphed: bool):
        runner = GPUModelRunner(variant, device, graphed)
        for size in CAPTURE_SIZES:          # capture_model: dummy runs of every size
            runner.execute_model([("dummy", 1, 0)] * size)
        outs = []
        runner._execute_encoder("a", pixels["a"])
        outs.append(runner.execute_model(prompt("a", [3, 7])))
        for step in range(5):
            tokens = [("a", (5 + step) % VOCAB, 6 + step)]
            if step == 1:                   # request b arrives: its image goes through the encoder
                runner._execute_encoder("b", pixels["b"])
                tokens += prompt("b", [9, 2, 4])
            elif step > 1:
                tokens.append(("b", (2 * step) % VOCAB, 5 + step))
            if step == 3:
                runner._execute_encoder("c", pixels["c"])
                tokens += prompt("c", [1])
            outs.append(runner.execute_model(tokens))
        return outs

    def served():
        with reuse_freed_blocks():          # freed device blocks go to the next allocation of their size
            return serve(True)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, lambda: serve(False))
