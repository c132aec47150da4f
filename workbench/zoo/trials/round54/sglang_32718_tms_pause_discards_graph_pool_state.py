"""Pausing the CUDA-graph memory through torch_memory_saver throws away state that replays read from the pool.

Upstream: https://github.com/sgl-project/sglang/pull/32718 ("[sglang-miles] Back up the CUDA graph pool
across TMS pause/resume").
Symptom: colocated RL (slime/miles): nondeterministic device crashes within a few RL steps, ``CUDA error:
misaligned address`` (sometimes surfacing later in cuBLAS or in the TMS free path), with trtllm_mla;
triton-backend runs and servers that never sleep are fine.
Mechanism: with the memory saver and ``SGLANG_MEMORY_SAVER_CUDA_GRAPH`` on,
``FullCudaGraphBackend.capture_one`` runs two warmups and captures under
``graph_ctx = partial(self._memory_saver_adapter.cuda_graph, tag=GPU_MEMORY_TYPE_CUDA_GRAPH)`` with
``pool=self._pool``: every block allocated during capture lives in a TMS region tagged ``cuda_graph``.
Some kernels keep device state across launches in that pool (kernel workspace metadata, scheduler
counters): initialised once, then only read and restored by the kernels themselves. Here the trtllm-gen MLA
decode's persistent tile scheduler keeps a ticket counter and a done counter in a workspace cached per
capture stream, so it is allocated (and zeroed, in the first graph only) during the first capture; every
launch starts handing out tiles at the ticket counter and the last CTA sets both back to 0.
``release_memory_occupation`` calls ``pause("cuda_graph")``: TMS keeps the virtual address, unmaps the pages
and, without CPU backup, discards their contents; ``resume_memory_occupation`` maps fresh pages with
undefined contents (modelled as 0xFF bytes). The next replay of a graph that does not re-zero the workspace
reads a garbage counter: tile -1 is out of range (the real kernel's misaligned address) and a real row is
never computed; the done counter misses its target, so the counters stay corrupt until the one graph that
zeroes the workspace happens to replay (hence nondeterministic, and only for stateful backends).
Doctor: dangling-reference, at ``capture_one`` (the capture site puts the graph's pool in a TMS region that
is released under the live graphs without backup; replays then read whatever the fresh pages hold).
Fix (upstream): one argument at the capture site: ``enable_cpu_backup=True`` in the ``cuda_graph(...)``
partial, so pause copies the pool to host and resume restores it bit-exact (~0.8 GB host RAM per rank).
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, hooks, randn, remember_step, replay

UPSTREAM = "https://github.com/sgl-project/sglang/pull/32718"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "capture_one"
SYMPTOM = "after an RL sleep/wake, replays read discarded scheduler state from the graph pool: crashes / wrong rows"

GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
HIDDEN, MAX_LEN = 4, 6
CAPTURE_BS = (4, 2, 1)                       # largest first, one shared pool


class TorchMemorySaver:
    """torch_memory_saver in miniature: allocations made inside a region are tagged; ``pause`` releases
    their pages (contents lost unless backed up), ``resume`` maps fresh pages at the same address."""

    def __init__(self):
        self.allocations = []                # (tag, enable_cpu_backup, tensor, host backup)
        self._region = None

    def malloc(self, numel, dtype, device):
        """The hooked allocator: inside a region the block is a TMS allocation."""
        t = torch.empty(numel, dtype=dtype, device=device)
        if self._region is not None:
            self.allocations.append([*self._region, t, None])
        return t

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, tag="default", enable_cpu_backup=False):
        self._region = (tag, enable_cpu_backup)
        try:
            with graph(cuda_graph, pool=pool, name=getattr(cuda_graph, "shape_key", None)):
                yield
        finally:
            self._region = None

    def pause(self, tag):
        for a in self.allocations:
            if a[0] == tag and a[1]:
                a[3] = a[2].detach().to("cpu", copy=True)

    def resume(self, tag):
        for a in self.allocations:
            if a[0] == tag:
                a[2].view(torch.uint8).fill_(0xFF)          # fresh physical pages: undefined contents
                if a[1]:
                    a[2].copy_(a[3].to(a[2].device))


class TrtllmMlaBackend:
    """Decode attention; the kernel library caches its workspace per stream (warmup vs capture stream)."""

    def __init__(self, memory_saver):
        self.memory_saver, self._workspaces = memory_saver, {}

    def _get_workspace(self, device):
        key = (str(device), torch.cuda.is_current_stream_capturing())
        if key not in self._workspaces:
            ws = self.memory_saver.malloc(2, torch.int32, device)
            ws.zero_()                       # "must be zero on first use": recorded in the first graph only
            self._workspaces[key] = ws
        return self._workspaces[key]

    def forward_decode(self, q, k_cache, seq_lens, out):
        """trtllm_batch_decode_with_kv_cache_mla: a persistent kernel; CTA i takes tile ticket + i."""
        bs, ws = q.shape[0], self._get_workspace(q.device)
        pos = torch.arange(MAX_LEN, device=q.device)
        scores = (k_cache[:bs] @ q[:, :, None]).squeeze(-1).masked_fill(pos[None, :] >= seq_lens[:, None], -1e9)
        attn = (torch.softmax(scores, -1)[:, :, None] * k_cache[:bs]).sum(1)
        ticket, done = ws[0], ws[1]
        tiles = torch.arange(bs, device=q.device) + ticket                   # tile ids the CTAs grab
        covered = (tiles[None, :] == torch.arange(bs, device=q.device)[:, None]).any(1)
        out.copy_(torch.where(covered[:, None], attn, out))                 # tiles nobody took: not written
        finished = done + bs
        reset = finished == bs                                               # the last CTA restores the state
        ws.copy_(torch.stack([torch.where(reset, 0, ticket + bs), torch.where(reset, 0, finished)]))
        return out


class DecodeModel:
    def __init__(self, device, backend):
        gen = generator(32718)
        self.wq = randn(HIDDEN, HIDDEN, gen=gen, device=device)
        self.wo = randn(HIDDEN, HIDDEN, gen=gen, device=device)
        self.backend = backend

    def forward(self, x, k_cache, seq_lens):
        out = torch.zeros(x.shape[0], HIDDEN, device=x.device)
        return self.backend.forward_decode(x @ self.wq, k_cache, seq_lens, out) @ self.wo


class FullCudaGraphBackend:
    def __init__(self, memory_saver, device, variant):
        self._graphs, self._outputs, self.device, self.variant = {}, {}, device, variant
        self._pool = graph_pool_handle(device)
        self._memory_saver_adapter = memory_saver

    def capture_one(self, shape_key, forward_fn, static):
        events.static_buffers("FullCudaGraphBackend", static)
        for _ in range(2):                   # two warmups: kernels loaded, one-time setup paid
            with events.warmup():
                forward_fn()
        g = new_graph(self.device)
        g.shape_key = f"decode bs {shape_key}"
        graph_ctx = partial(self._memory_saver_adapter.cuda_graph, tag=GPU_MEMORY_TYPE_CUDA_GRAPH)
        if self.variant == "fix":            # replays read capture-time state from the pool: back it up
            graph_ctx = partial(graph_ctx, enable_cpu_backup=True)
        with graph_ctx(cuda_graph=g, pool=self._pool, stream=None):
            out = forward_fn()
        remember_step(g, forward_fn)
        for hook in hooks:
            hook.captured(g, forward_fn)
        self._graphs[shape_key], self._outputs[shape_key] = g, out

    def replay(self, shape_key):
        return replay(self._graphs[shape_key], self._outputs[shape_key])


def run(variant: str, device: str = "cpu"):
    gen = generator(327180)
    k_cache = randn(max(CAPTURE_BS), MAX_LEN, HIDDEN, gen=gen, device=device)
    before, after = (4, 2, 1, 2), (2, 1, 4, 2)                          # decode steps around one RL sleep/wake
    steps = [(randn(bs, HIDDEN, gen=gen, device=device),
              torch.randint(1, MAX_LEN + 1, (bs,), generator=gen).to(device)) for bs in before + after]

    def eager():
        model = DecodeModel(device, TrtllmMlaBackend(TorchMemorySaver()))
        return [model.forward(x, k_cache, lens).clone() for x, lens in steps]

    def served():
        memory_saver = TorchMemorySaver()
        model = DecodeModel(device, TrtllmMlaBackend(memory_saver))
        runner = FullCudaGraphBackend(memory_saver, device, variant)
        x_buf = torch.zeros(max(CAPTURE_BS), HIDDEN, device=device)
        lens_buf = torch.ones(max(CAPTURE_BS), dtype=torch.long, device=device)
        events.persistent_state("KV cache", {"k_cache": k_cache})
        for bs in CAPTURE_BS:
            runner.capture_one(bs, lambda bs=bs: model.forward(x_buf[:bs], k_cache, lens_buf[:bs]),
                               {"input_embeds": x_buf, "seq_lens": lens_buf})
        outs = []
        for i, (x, lens) in enumerate(steps):
            if i == len(before):             # release_memory_occupation / training / resume_memory_occupation
                memory_saver.pause(GPU_MEMORY_TYPE_CUDA_GRAPH)
                memory_saver.resume(GPU_MEMORY_TYPE_CUDA_GRAPH)
            bs = x.shape[0]
            x_buf[:bs].copy_(x)
            lens_buf[:bs].copy_(lens)
            outs.append(runner.replay(bs).clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
