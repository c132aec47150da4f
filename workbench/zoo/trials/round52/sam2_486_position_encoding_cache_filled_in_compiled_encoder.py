"""SAM 2's ``PositionEmbeddingSine.cache`` is filled inside the compiled image encoder, so it holds cudagraph-pool memory the tree frees.

Upstream: https://github.com/facebookresearch/sam2/pull/486 ("SAM 2 Update 12/11/2024 -- full model compilation for a
major VOS speedup ...", squash commit 393ae33), which fixes https://github.com/facebookresearch/sam2/issues/460
("compile_image_encoder: true causes cudagraph overwriting crash"; confirmed fixed in #501).
Symptom: with ``compile_image_encoder: true`` (``torch.compile(self.image_encoder.forward, mode="max-autotune",
fullgraph=True, dynamic=False)``: cudagraph trees) VOS inference crashes on the second frame with "Error: accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run"; without that check the position
encodings would be read from memory the pool has handed on.
Mechanism: the FPN neck calls ``PositionEmbeddingSine.forward(x)`` for every level. Before the fix ``forward`` was a
lazy cache: on a miss it built ``pos`` (arange, sin/cos) and stored ``self.cache[cache_key] = pos[0]``. The first
call happens inside the compiled region: the tree's first invocation of a new function is its warmup
(``CUDAWarmupNode``), which runs with the cudagraph pool as allocator, and dynamo replays the dict store with that
output, so the host dict keeps a tensor of pool memory. The dict changed, so frame 1 fails dynamo's guard on the
cache's keys and recompiles (the hit branch, ``self.cache[key][None].repeat(B, 1, 1, 1)``, the cached tensor now a
graph input); the compile bumps ``GenerationTracker.generation``, the tree starts a new generation and
``dealloc_current_path_weakrefs`` frees the previous path's outputs (``_free_And_Remove_DeleterFn``), the live
cached ``pos[0]`` included. The recompiled encoder then reads the freed cache.
Doctor: dangling-reference, at ``_pe`` (its lazy fill, run in the compiled encoder's warmup, leaves the host cache
holding pool memory that the tree releases at the next generation while later frames still read it).
Fix (upstream): ``PositionEmbeddingSine.__init__`` takes ``warmup_cache=True, image_size=1024, strides=(4, 8, 16,
32)`` and fills the cache eagerly (``self._pe(1, device, *cache_key)`` for every stride) before anything is
compiled; ``forward`` only calls ``_pe``, which on a hit returns ``self.cache[key].to(device)[None].repeat(B, 1, 1,
1)``. (The PR's ``.clone()`` hunks for backbone/prompt/decoder outputs are not modelled.) Read: ``git show 393ae33
-- sam2/modeling/position_encoding.py`` and the pre-fix file.
"""
from __future__ import annotations

import math

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/facebookresearch/sam2/pull/486"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_pe"
SYMPTOM = "second frame crashes: the position-encoding cache holds a warmup output the cudagraph tree freed"

IMAGE_SIZE, STRIDES, D_MODEL, BATCH, FRAMES = 16, (4, 8), 4, 1, 4


class PositionEmbeddingSine:
    def __init__(self, num_pos_feats, device, temperature=10000, warmup_cache=True, image_size=IMAGE_SIZE,
                 strides=STRIDES):
        self.num_pos_feats = num_pos_feats // 2
        self.temperature, self.scale = temperature, 2 * math.pi
        self.cache = {}
        if warmup_cache:                      # the fix: fill the cache eagerly, before any compile
            for stride in strides:
                cache_key = (image_size // stride, image_size // stride)
                self._pe(1, device, *cache_key)

    @torch.no_grad()
    def _pe(self, B, device, *cache_key):
        H, W = cache_key
        if cache_key in self.cache:
            return self.cache[cache_key].to(device)[None].repeat(B, 1, 1, 1)
        y_embed = torch.arange(1, H + 1, dtype=torch.float32, device=device).view(1, -1, 1).repeat(B, 1, W)
        x_embed = torch.arange(1, W + 1, dtype=torch.float32, device=device).view(1, 1, -1).repeat(B, H, 1)
        y_embed = y_embed / (y_embed[:, -1:, :] + 1e-6) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + 1e-6) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos = torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)
        self.cache[cache_key] = pos[0]        # inside the compiled region: a tensor of the graph's memory
        return pos

    @torch.no_grad()
    def forward(self, x):
        return self._pe(x.shape[0], x.device, x.shape[-2], x.shape[-1])


class ImageEncoder:
    """Trunk (pooled patches) and FpnNeck (a 1x1 projection per level plus its position encoding)."""

    def __init__(self, gen, device, warmup_cache):
        self.convs = [randn(3, D_MODEL, gen=gen, device=device, scale=0.5) for _ in STRIDES]
        self.position_encoding = PositionEmbeddingSine(D_MODEL, device, warmup_cache=warmup_cache)

    def forward(self, sample):
        backbone_fpn, vision_pos_enc = [], []
        for stride, w in zip(STRIDES, self.convs):
            feat = torch.nn.functional.avg_pool2d(sample, stride)
            x_out = torch.tanh(torch.einsum("bchw,cd->bdhw", feat, w))
            backbone_fpn.append(x_out)
            vision_pos_enc.append(self.position_encoding.forward(x_out))
        return (*backbone_fpn, *vision_pos_enc)


class GenerationTracker:
    generation = 0                            # bumped by every dynamo frame compile


class CUDAGraphTreeManager:
    """One tree, one pool: a function's first call is its warmup, the second is recorded, later ones replay."""

    def __init__(self, device):
        self.device = device
        self.cuda_graphs_thread_pool = graph_pool_handle(device)
        self.current_gen = -1
        self.path_live_weakrefs: list[StorageWeakRef] = []
        self.warmed_up: set[str] = set()
        self.nodes: dict[str, tuple] = {}

    def dealloc_current_path_weakrefs(self):
        """New generation: the path's outputs are dead; still-live storages are freed (``_free_And_Remove_DeleterFn``)."""
        for ref in self.path_live_weakrefs:
            if not ref.expired():
                torch.UntypedStorage._new_with_weak_ptr(ref.cdata).resize_(0)
        self.path_live_weakrefs = []

    def run(self, function_id, fn, sample):
        if GenerationTracker.generation != self.current_gen:      # can_start_new_generation()
            self.dealloc_current_path_weakrefs()
            self.current_gen = GenerationTracker.generation
        if function_id not in self.warmed_up:                      # CUDAWarmupNode: runs in the pool
            self.warmed_up.add(function_id)
            with events.warmup(real=True):
                out = fn(sample)
            self.path_live_weakrefs += [StorageWeakRef(t.untyped_storage()) for t in out]
            return out
        if function_id not in self.nodes:                          # record_function
            static = sample.clone()
            g, outs = capture(lambda: fn(static), device=self.device, pool=self.cuda_graphs_thread_pool,
                              warmups=0, name=function_id, static={"sample": static}, owner="CUDAGraphTreeManager")
            self.nodes[function_id] = (g, static, outs)
        g, static, outs = self.nodes[function_id]
        static.copy_(sample)
        return replay(g, outs)


def compile_image_encoder(encoder, manager):
    """``torch.compile(image_encoder.forward, fullgraph=True, dynamic=False)``: guarded on the cache's keys."""
    compiled: dict[tuple, str] = {}

    def forward(sample):
        guard = tuple(sorted(encoder.position_encoding.cache))
        if guard not in compiled:                                  # guard failure: recompile
            GenerationTracker.generation += 1
            compiled[guard] = f"image_encoder.forward#{len(compiled)}"
        return manager.run(compiled[guard], encoder.forward, sample)
    return forward


def run(variant: str, device: str = "cpu"):
    gen = generator(460)
    frames = [randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, gen=gen, device=device) for _ in range(FRAMES)]

    def track(encode):
        outs = []
        for frame in frames:
            feats = encode(frame)
            n = len(STRIDES)
            outs += [(f + p).mean(dim=(2, 3)).clone() for f, p in zip(feats[:n], feats[n:])]
        return outs

    def eager():
        encoder = ImageEncoder(generator(486), device, warmup_cache=False)
        return track(encoder.forward)

    def served():
        GenerationTracker.generation = 0
        encoder = ImageEncoder(generator(486), device, warmup_cache=(variant == "fix"))
        return track(compile_image_encoder(encoder, CUDAGraphTreeManager(device)))

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
