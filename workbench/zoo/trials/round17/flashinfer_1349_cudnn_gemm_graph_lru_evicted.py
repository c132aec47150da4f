"""The LRU cache of cuDNN GEMM graphs evicts a plan that an earlier-captured CUDA graph still launches.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/1349 ("[Bugfix] Change max_size for LRU").
Symptom: SGLang using FlashInfer's cuDNN GEMM backend (``mm_fp4``) with CUDA graphs crashes with "Fatal
Python error: Segmentation fault" inside ``torch/cuda/graphs.py`` ``replay`` (called from SGLang's
``cuda_graph_runner.replay``): "LRU cache eviction blocks frameworks for cuda graph replay" (FlashInfer
0.2.x, July 2025).
Mechanism: ``mm_fp4`` builds a cuDNN graph (and its execution plan) per input signature with
``build_cudnn_gemm_block_scale_dequantize_graph``, memoised by ``functools.lru_cache(maxsize=128)`` on the
shapes and strides, so every (capture size, layer shape) pair is a distinct entry. A CUDA graph captured
around ``execute_cudnn_gemm_fp4_graph`` records launches that use the plan's own device-side resources. When
the captures of the later batch sizes push the number of signatures past the cache size, the LRU drops the
oldest entries; the dropped cuDNN graph is destroyed and its state released, but the CUDA graphs of the
first batch sizes still launch with it. Eager calls simply rebuild the evicted graph on a cache miss;
replays cannot, and fault. (The plan's device state is modelled as the block-scale layout index the
dequantising GEMM reads; the cache size is scaled from 128 to the tiny shapes here.)
Doctor: dangling-reference, at ``build_cudnn_gemm_block_scale_dequantize_graph`` (its bounded cache is the
owner that lets go of what the captured launches read).
Fix (upstream): memoise the cuDNN graph builders with ``functools.cache`` (never evicts), so every plan a
captured graph uses stays alive for the process.
"""
from __future__ import annotations

import functools

import torch

from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/1349"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "build_cudnn_gemm_block_scale_dequantize_graph"
SYMPTOM = "replaying an early batch size's graph segfaults: its cuDNN plan was evicted from the LRU cache"
HIDDEN, INTER, BLOCK_SIZE = 4, 6, 2
LRU_MAXSIZE = 4                       # 128 upstream: fewer signatures than (capture sizes x layer shapes)
CAPTURE_SIZES = (1, 2, 3)


class CudnnGraph:
    """The cuDNN frontend graph with its built execution plan; destroying it releases the plan's state."""

    def __init__(self, a_shape, b_shape, block_size, device):
        k = a_shape[1]
        # the plan's device-resident state (own allocation): which block scale each K element uses
        self.plan_state = torch.zeros(max(own_segment_elems(device), k), dtype=torch.long, device=device)
        self.plan_state[:k] = torch.arange(k, device=device) // block_size
        self.k = k

    def get_workspace_size(self):
        return 8


def _build_cudnn_gemm_block_scale_dequantize_graph(a_shape, a_stride, b_shape, b_stride, block_size, device):
    return CudnnGraph(a_shape, b_shape, block_size, device)


def build_cudnn_gemm_block_scale_dequantize_graph(variant: str):
    """The memoised builder: ``@functools.lru_cache(maxsize=128)`` before the fix, ``@functools.cache`` after."""
    if variant == "fix":
        return functools.cache(_build_cudnn_gemm_block_scale_dequantize_graph)
    return functools.lru_cache(maxsize=LRU_MAXSIZE)(_build_cudnn_gemm_block_scale_dequantize_graph)


def execute_cudnn_gemm_fp4_graph(graph, a, b, a_descale, b_descale, alpha, c_final):
    workspace = torch.empty(graph.get_workspace_size(), device=a.device, dtype=torch.uint8)   # noqa: F841
    scale_index = graph.plan_state[:graph.k]
    a_deq = a * a_descale[:, scale_index]
    b_deq = b * b_descale[:, scale_index]
    c_final.copy_((a_deq @ b_deq.t()) * alpha)


def mm_fp4(a, b, a_descale, b_descale, alpha, out, build_graph):
    graph = build_graph(tuple(a.shape), tuple(a.stride()), tuple(b.shape), tuple(b.stride()), BLOCK_SIZE,
                        str(a.device))
    execute_cudnn_gemm_fp4_graph(graph, a, b, a_descale, b_descale, alpha, out)
    return out


class Fp4Mlp:
    """Two FP4 linears (quantised values + per-block scales), each a distinct GEMM signature per batch size."""

    def __init__(self, device):
        gen = generator(1349)
        self.w1 = randn(INTER, HIDDEN, gen=gen, device=device).round()
        self.w1_scale = randn(INTER, HIDDEN // BLOCK_SIZE, gen=gen, device=device, scale=0.3).abs() + 0.1
        self.w2 = randn(HIDDEN, INTER, gen=gen, device=device).round()
        self.w2_scale = randn(HIDDEN, INTER // BLOCK_SIZE, gen=gen, device=device, scale=0.3).abs() + 0.1
        self.alpha = 0.5

    def forward(self, x, x_scale, build_graph):
        m = x.shape[0]
        h = mm_fp4(x, self.w1, x_scale, self.w1_scale, self.alpha,
                   torch.empty(m, INTER, device=x.device), build_graph)
        h = torch.relu(h).round()
        h_scale = torch.ones(m, INTER // BLOCK_SIZE, device=x.device)
        return mm_fp4(h, self.w2, h_scale, self.w2_scale, self.alpha,
                      torch.empty(m, HIDDEN, device=x.device), build_graph)


def run(variant: str, device: str = "cpu"):
    model = Fp4Mlp(device)
    gen = generator(13490)
    steps = [(randn(m, HIDDEN, gen=gen, device=device).round(),
              randn(m, HIDDEN // BLOCK_SIZE, gen=gen, device=device, scale=0.2).abs() + 0.5)
             for m in (1, 3, 2, 1)]

    def eager():
        build_graph = build_cudnn_gemm_block_scale_dequantize_graph(variant)
        return [model.forward(x, s, build_graph).clone() for x, s in steps]

    def served():
        build_graph = build_cudnn_gemm_block_scale_dequantize_graph(variant)
        graphs = {}
        for bs in CAPTURE_SIZES:                       # the runner captures every batch size at startup
            x_buf = torch.zeros(bs, HIDDEN, device=device)
            s_buf = torch.ones(bs, HIDDEN // BLOCK_SIZE, device=device)
            g, out = capture(lambda x=x_buf, s=s_buf: model.forward(x, s, build_graph), device=device,
                             warmups=2, static={"x": x_buf, "x_scale": s_buf}, name=f"size {bs}",
                             owner="CudaGraphRunner (mm_fp4, cudnn backend)")
            graphs[bs] = (g, out, x_buf, s_buf)
        release_to_driver(device)
        outs = []
        for x, s in steps:
            g, out, x_buf, s_buf = graphs[x.shape[0]]
            x_buf.copy_(x)
            s_buf.copy_(s)
            outs.append(replay(g, out).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
