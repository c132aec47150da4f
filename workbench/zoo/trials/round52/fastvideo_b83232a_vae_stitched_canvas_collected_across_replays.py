"""Tiled VAE decode keeps each chunk's stitched canvas, a CUDA-graph output that the next chunk's replay overwrites.

Upstream: https://github.com/hao-ai-lab/FastVideo/commit/b83232a94dd20096dac777129b93627443552892 ("[bugfix] H3
VAE: clone the reduce-overhead stitched canvas at the tile-driver returns (#1734 review F1)"), landed on main in
the squash of https://github.com/hao-ai-lab/FastVideo/pull/1734.
Symptom: the first tiled ``decode()`` of any real video (two or more temporal chunks) raised "RuntimeError: Error:
accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run ... in _stitch_tiles: return
torch.cat(result_rows, dim=-2)"; without PyTorch's poison check every earlier chunk of the video silently holds
the last chunk's pixels.
Mechanism: ``AutoencoderKLMiniMaxH3._stitch_tiles`` is decorated with ``@torch.compile(mode="reduce-overhead",
dynamic=False)``: it blends the tile overlaps and returns ``torch.cat(result_rows, dim=-2)``, the static output of
one CUDA graph (the spatial tile grid is fixed, so every clip replays the same graph). ``_decode_clip`` returned
that canvas directly. ``_decode_chunks`` slices chunk k out of it (``clip[:, :, frame_pre_padding:chunk_num_frames]``,
a view) and yields it; ``_decode`` collects all chunks with ``list(self._decode_chunks(z))`` before ``torch.cat``.
So chunk 0 is still held in the list while chunk 1's ``_stitch_tiles`` replay writes its canvas into the same
pooled storage: at the final ``torch.cat`` every chunk reads the last chunk's canvas. Python runs the blending only
at warmup/capture; each later call just copies the new tiles into the static inputs and replays.
Doctor: overwritten-output, at ``_decode_clip`` (the tile driver hands the graph-owned canvas to a caller that keeps
it across the next replay of the same graph).
Fix (upstream): ``return self._stitch_tiles(rows, y_overlaps, x_overlaps).clone()`` in ``_decode_clip`` (and the
same in ``_encode_clip``): each caller gets a tensor it owns, copied out before the next replay.
Read: the diff and the pre-fix ``_stitch_tiles`` / ``_decode_clip`` / ``_decode_chunks`` / ``_decode``.
``ReduceOverheadStitch`` stands for the ``torch.compile(mode="reduce-overhead")`` wrapper (static inputs, warm up,
capture, replay the static output); ``post_quant_conv`` and the decoder are tiny stand-ins, run eagerly.
"""
from __future__ import annotations

import math

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/hao-ai-lab/FastVideo/commit/b83232a94dd20096dac777129b93627443552892"
FAMILY = "persistent-buffer mutation"
KIND = "overwritten-output"
SITE = "_decode_clip"
SYMPTOM = "every temporal chunk of a tiled decode reads the last chunk's stitched canvas (graph output reused)"

LATENT_CHANNELS, OUT_CHANNELS = 2, 3
SPATIAL_RATIO, TEMPORAL_RATIO = 2, 2
TOKENS_CHUNK_SIZE = 2                       # latent frames per temporal chunk (token_drop = 0: no chunk overlap)
TILE_MIN, TILE_MIN_OVERLAP = 6, 2            # tile_sample_min_height/width, tile_sample_min_overlap_height/width


class ReduceOverheadStitch:
    """``@torch.compile(mode="reduce-overhead", dynamic=False)`` on ``_stitch_tiles``: the tiles are copied into
    static inputs (one set per guarded shape/overlap key), the first call warms up and captures, every call returns
    the graph's static output canvas."""

    def __init__(self, fn, device):
        self.fn, self.device = fn, device
        self.graphs: dict = {}

    def __call__(self, tiles, height_overlaps, width_overlaps):
        key = (tuple(tuple(t.shape) for row in tiles for t in row), tuple(height_overlaps), tuple(width_overlaps))
        entry = self.graphs.get(key)
        if entry is None:
            static_tiles = [[t.clone() for t in row] for row in tiles]
            g, out = capture(lambda: self.fn(static_tiles, list(height_overlaps), list(width_overlaps)),
                             device=self.device, warmups=1, name="_stitch_tiles",
                             owner="torch.compile(_stitch_tiles, mode='reduce-overhead')",
                             static={f"tile_{i}_{j}": t for i, row in enumerate(static_tiles)
                                     for j, t in enumerate(row)})
            entry = self.graphs[key] = (g, static_tiles, out)
        g, static_tiles, out = entry
        for static_row, row in zip(static_tiles, tiles):
            for static, tile in zip(static_row, row):
                static.copy_(tile)
        return replay(g, out)


class AutoencoderKLMiniMaxH3:
    def __init__(self, device, variant, compiled):
        gen = generator(1734)
        self.variant = variant
        self.spatial_compression_ratio, self.temporal_compression_ratio = SPATIAL_RATIO, TEMPORAL_RATIO
        self.tokens_chunk_size, self.frame_pre_padding = TOKENS_CHUNK_SIZE, 0
        self.tile_sample_min_height = self.tile_sample_min_width = TILE_MIN
        self.tile_sample_min_overlap_height = self.tile_sample_min_overlap_width = TILE_MIN_OVERLAP
        self.use_tiling = True
        self.w_post_quant = randn(LATENT_CHANNELS, LATENT_CHANNELS, gen=gen, device=device, scale=0.8)
        self.w_decoder = randn(OUT_CHANNELS, LATENT_CHANNELS, gen=gen, device=device, scale=0.8)
        self._stitch = ReduceOverheadStitch(self._stitch_tiles_impl, device) if compiled else self._stitch_tiles_impl

    def _split_tiles(self, length, tile_size, min_overlap):
        if tile_size >= length:
            return [0], [length], []
        num_tiles = math.ceil(length / tile_size)
        while tile_size * num_tiles - min_overlap * (num_tiles - 1) - length < 0:
            num_tiles += 1
        overlaps = [min_overlap] * (num_tiles - 1)
        remaining = tile_size * num_tiles - sum(overlaps) - length
        for index in range(remaining // self.spatial_compression_ratio):
            overlaps[index % (num_tiles - 1)] += self.spatial_compression_ratio
        tile_start_indices = [0]
        for index in range(num_tiles - 1):
            tile_start_indices.append(tile_start_indices[-1] + tile_size - overlaps[index])
        return tile_start_indices, [tile_size] * num_tiles, overlaps

    @staticmethod
    def _blend(a, b, blend_extent, dim):
        blend_extent = min(a.shape[dim], b.shape[dim], blend_extent)
        positions = torch.arange(blend_extent, device=b.device, dtype=b.dtype)
        shape = [1] * a.ndim
        shape[dim] = blend_extent
        weight_a, weight_b = (1 - positions / blend_extent).view(shape), (positions / blend_extent).view(shape)
        blended = (a.narrow(dim, a.shape[dim] - blend_extent, blend_extent) * weight_a
                   + b.narrow(dim, 0, blend_extent) * weight_b)
        if blend_extent == b.shape[dim]:
            return blended
        return torch.cat([blended, b.narrow(dim, blend_extent, b.shape[dim] - blend_extent)], dim=dim)

    def _stitch_tiles_impl(self, tiles, height_overlaps, width_overlaps):
        """Blend decoded tile overlaps and concatenate the spatial canvas (the compiled function)."""
        result_rows = []
        for row_index, row in enumerate(tiles):
            result_row = []
            for column_index, tile in enumerate(row):
                if row_index > 0:
                    tile = self._blend(tiles[row_index - 1][column_index], tile, height_overlaps[row_index - 1], -2)
                if column_index > 0:
                    tile = self._blend(row[column_index - 1], tile, width_overlaps[column_index - 1], -1)
                if row_index < len(tiles) - 1:
                    tile = tile[..., :-height_overlaps[row_index], :]
                if column_index < len(row) - 1:
                    tile = tile[..., :, :-width_overlaps[column_index]]
                result_row.append(tile)
            result_rows.append(torch.cat(result_row, dim=-1))
        return torch.cat(result_rows, dim=-2)

    def _stitch_tiles(self, tiles, height_overlaps, width_overlaps):
        return self._stitch(tiles, height_overlaps, width_overlaps)

    def _project_decoder_tile(self, tile):
        return torch.einsum("oc,bcthw->bothw", self.w_post_quant, tile)           # post_quant_conv (1x1x1)

    def decoder(self, x):
        up = x.repeat_interleave(TEMPORAL_RATIO, 2).repeat_interleave(SPATIAL_RATIO, 3)
        up = up.repeat_interleave(SPATIAL_RATIO, 4)
        return torch.tanh(torch.einsum("oc,bcthw->bothw", self.w_decoder, up))

    def _decode_clip(self, z):
        """Decode one temporal clip with overlapping spatial tiles."""
        height, width = z.shape[-2] * SPATIAL_RATIO, z.shape[-1] * SPATIAL_RATIO
        y_indices, y_lengths, y_overlaps = self._split_tiles(height, self.tile_sample_min_height,
                                                             self.tile_sample_min_overlap_height)
        x_indices, x_lengths, x_overlaps = self._split_tiles(width, self.tile_sample_min_width,
                                                             self.tile_sample_min_overlap_width)
        ratio, rows = SPATIAL_RATIO, []
        for y_position, y_length in zip(y_indices, y_lengths):
            row = []
            for x_position, x_length in zip(x_indices, x_lengths):
                tile = z[..., y_position // ratio:(y_position + y_length) // ratio,
                         x_position // ratio:(x_position + x_length) // ratio]
                row.append(self.decoder(self._project_decoder_tile(tile)))
            rows.append(row)
        if self.variant == "fix":
            return self._stitch_tiles(rows, y_overlaps, x_overlaps).clone()   # a caller-owned canvas
        return self._stitch_tiles(rows, y_overlaps, x_overlaps)              # the graph's static output

    def _decode_chunks(self, z):
        """Yield finalized temporal chunks in decode order (token_drop = 0: no inter-chunk overlap)."""
        chunk_num_frames = self.tokens_chunk_size * self.temporal_compression_ratio
        num_chunks = z.shape[2] // self.tokens_chunk_size
        for chunk_index in range(num_chunks):
            start = chunk_index * self.tokens_chunk_size
            clip = self._decode_clip(z[:, :, start:start + self.tokens_chunk_size])
            yield clip[:, :, self.frame_pre_padding:chunk_num_frames]              # a view of the canvas

    def _decode(self, z):
        return torch.cat(list(self._decode_chunks(z)), dim=2)

    def decode(self, z):
        return self._decode(z)


def run(variant: str, device: str = "cpu"):
    gen = generator(2026)
    # three videos of 3 temporal chunks each: 6 latent frames, 5x5 latents -> 10x10 pixels in a 2x2 tile grid
    latents = [randn(1, LATENT_CHANNELS, 3 * TOKENS_CHUNK_SIZE, 5, 5, gen=gen, device=device) for _ in range(3)]

    def generate(compiled: bool):
        vae = AutoencoderKLMiniMaxH3(device, variant, compiled)
        return [vae.decode(z) for z in latents]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: generate(True), lambda: generate(False))
