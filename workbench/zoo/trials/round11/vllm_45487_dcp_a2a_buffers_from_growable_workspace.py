"""DCP all-to-all send/recv buffers come from the growable workspace: a post-capture warmup regrows it under the graphs.

Upstream: https://github.com/vllm-project/vllm/pull/45487 ("[Bugfix][DCP] Fix illegal memory access in DCP a2a
decode under full CUDA graphs").
Symptom: ``--decode-context-parallel-size 4 --dcp-comm-backend a2a`` with FULL CUDA graphs
(``FULL_AND_PIECEWISE``) kills every worker with "CUDA error: an illegal memory access" on the first request
(Kimi-K2.5-NVFP4, TP4/DCP4, vLLM main, June 2026); eager or piecewise decode attention is fine.
Mechanism: with DCP every rank attends over its own shard of the KV cache and ``dcp_a2a_lse_reduce`` combines
the partial outputs: it packs output and LSE into a send buffer, exchanges it with ``all_to_all_single`` and
LSE-combines what it received. ``_dcp_a2a_send_recv_buffers`` drew both buffers from the shared
``WorkspaceManager`` arena. The FULL decode graphs bake the arena's address in at capture; vLLM's warmup after
capture then runs a larger batch through the same combine, ``_ensure_workspace_size`` replaces the arena by a
bigger one (``del current_workspace; torch.accelerator.empty_cache()``), and every captured decode graph is
left packing into and reading from the freed block.
Doctor: dangling-reference, at ``_dcp_a2a_send_recv_buffers`` (the graph's a2a buffers are views of an arena
the graph does not own, which its owner frees when it grows).
Fix (upstream): allocate the send/recv buffers with ``torch.empty``, so that inside a capture they live in the
CUDA graph's private pool (as ``_dcp_a2a_unpack_combine``'s outputs already did).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import GraphManager, events
from workbench.zoo.kit import compare, generator, own_segment_elems, randn, release_to_driver

UPSTREAM = "https://github.com/vllm-project/vllm/pull/45487"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_dcp_a2a_send_recv_buffers"
SYMPTOM = "illegal memory access on the first decode after the post-capture warmup regrew the workspace"

VOCAB, NUM_HEADS, HEAD_DIM, CTX = 12, 2, 4, 8
DCP_WORLD_SIZE = 2                        # this process is DCP rank 0; rank 1's partial output is its peer's
MAX_NUM_REQS = 4
DUMMY_REQ = MAX_NUM_REQS                  # KV row the dummy runs write to
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]       # uniform decode: one token per request
MAX_NUM_BATCHED_TOKENS = 8                # the post-capture warmup runs this many tokens
PROMPTS = [[3, 7, 1], [5, 1, 9, 2], [2, 6]]
SCHEDULE = [[0, 1, 2], [0, 1, 2], [0, 1], [0]]          # request ids per decode step (3 pads to 4)


class WorkspaceManager:
    """``vllm.v1.worker.workspace.WorkspaceManager``: one shared arena handed out in slices."""

    def __init__(self, device):
        self._device = device
        self._current_workspaces: list[torch.Tensor | None] = [None]
        # the arena is its own allocator segment on CUDA, so that empty_cache() unmaps it
        self._granularity = max(1, own_segment_elems(device) // 16)

    def get_simultaneous(self, *shapes_and_dtypes):
        numels = [math.prod(shape) for shape, _ in shapes_and_dtypes]
        workspace = self._ensure_workspace_size(sum(numels))
        views, offset = [], 0
        for (shape, dtype), numel in zip(shapes_and_dtypes, numels):
            views.append(workspace[offset:offset + numel].view(shape).view(dtype))
            offset += numel
        return views

    def _ensure_workspace_size(self, required: int) -> torch.Tensor:
        current_workspace = self._current_workspaces[0]
        if current_workspace is not None and current_workspace.numel() >= required:
            return current_workspace
        self._current_workspaces[0] = None
        del current_workspace
        release_to_driver(self._device)                    # torch.accelerator.empty_cache()
        self._current_workspaces[0] = torch.empty(required * self._granularity, dtype=torch.float32,
                                                  device=self._device)
        return self._current_workspaces[0]


_workspace_manager: WorkspaceManager | None = None


def is_workspace_manager_initialized() -> bool:
    return _workspace_manager is not None


def current_workspace_manager() -> WorkspaceManager:
    assert _workspace_manager is not None
    return _workspace_manager


class GroupCoordinator:
    """The DCP group as rank 0 sees it. ``all_to_all_single`` is a loopback stand-in for NCCL: the chunk
    rank 1 sends to rank 0 is packed here from rank 1's partial output (``peer``), set by the forward."""

    def __init__(self, world_size: int):
        self.world_size, self.rank_in_group = world_size, 0
        self.peer: tuple[torch.Tensor, torch.Tensor] | None = None

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        recv, send = output.view(self.world_size, -1), input.view(self.world_size, -1)
        recv[self.rank_in_group].copy_(send[self.rank_in_group])
        peer_out, peer_lse = self.peer
        B, H, D = peer_out.shape
        peer_send = torch.empty((self.world_size, B, H // self.world_size, D + 1), device=peer_out.device,
                                dtype=peer_out.dtype)
        _dcp_a2a_pack_send(peer_out, peer_lse, peer_send, self.world_size, H // self.world_size, D)
        recv[1 - self.rank_in_group].copy_(peer_send.view(self.world_size, -1)[self.rank_in_group])


def _dcp_a2a_send_recv_buffers(shape, device, dtype, variant: str):
    if variant == "bug" and is_workspace_manager_initialized():
        send_buffer, recv_buffer = current_workspace_manager().get_simultaneous((shape, dtype), (shape, dtype))
        return send_buffer, recv_buffer
    return (torch.empty(shape, device=device, dtype=dtype),     # the fix: graph-pool memory under capture
            torch.empty(shape, device=device, dtype=dtype))


def _dcp_a2a_pack_send(cp_attn_out, cp_attn_lse, send_buffer, world_size, h_per_rank, head_dim):
    """``_dcp_a2a_pack_send_kernel``: heads of rank n to slot n, the fp32 LSE packed after the head dim."""
    for rank_idx in range(world_size):
        heads = slice(rank_idx * h_per_rank, (rank_idx + 1) * h_per_rank)
        send_buffer[rank_idx, :, :, :head_dim].copy_(cp_attn_out[:, heads])
        send_buffer[rank_idx, :, :, head_dim].copy_(cp_attn_lse[:, heads])


def _dcp_a2a_unpack_combine(recv_buffer, head_dim):
    """``_dcp_a2a_unpack_combine_kernel``: exact LSE-weighted sum over the source ranks."""
    outs, lses = recv_buffer[..., :head_dim], recv_buffer[..., head_dim]
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), torch.full_like(lses, -float("inf")), lses)
    lse_max = lses.max(0).values
    lse_max = torch.where(lse_max == -float("inf"), torch.zeros_like(lse_max), lse_max)
    global_lse = torch.log(torch.exp(lses - lse_max).sum(0)) + lse_max
    weight = torch.exp(lses - global_lse)
    weight = torch.where(torch.isnan(weight), torch.zeros_like(weight), weight)
    out = torch.empty(recv_buffer.shape[1:3] + (head_dim,), device=recv_buffer.device, dtype=recv_buffer.dtype)
    out.copy_((outs * weight[..., None]).sum(0))
    return out


def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group: GroupCoordinator, variant: str):
    """Combine partial attention outputs across DCP ranks using All-to-All: [B, H, D] -> [B, H/N, D]."""
    world_size = cp_group.world_size
    B, H, D = cp_attn_out.shape
    H_per_rank = H // world_size
    lse_pack_dim = 1                                        # fp32 output: the LSE takes one element
    send_buffer, recv_buffer = _dcp_a2a_send_recv_buffers((world_size, B, H_per_rank, D + lse_pack_dim),
                                                          cp_attn_out.device, cp_attn_out.dtype, variant)
    _dcp_a2a_pack_send(cp_attn_out, cp_attn_lse, send_buffer, world_size, H_per_rank, D)
    cp_group.all_to_all_single(recv_buffer.view(-1), send_buffer.view(-1))
    return _dcp_a2a_unpack_combine(recv_buffer, D)


class Model:
    def __init__(self, device):
        gen = generator(45487)
        self.emb = randn(VOCAB, NUM_HEADS * HEAD_DIM, gen=gen, device=device)
        self.pos = randn(CTX, NUM_HEADS * HEAD_DIM, gen=gen, device=device, scale=0.5)
        d = NUM_HEADS * HEAD_DIM
        self.wq, self.wk, self.wv = (randn(d, d, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(HEAD_DIM * NUM_HEADS // DCP_WORLD_SIZE, VOCAB, gen=gen, device=device, scale=0.5)


def dcp_local_attention(q, keys, values, positions, dcp_rank):
    """The decode kernel on one DCP rank: its KV shard holds the positions ``p % world == rank``.
    Returns the partial output and its LSE (-inf where the shard has nothing yet)."""
    ctx = torch.arange(CTX, device=q.device)
    valid = (ctx[None, :] <= positions[:, None]) & (ctx[None, :] % DCP_WORLD_SIZE == dcp_rank)   # [B, CTX]
    scores = torch.einsum("bhd,bchd->bhc", q, keys) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(~valid[:, None, :], -float("inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("bhc,bchd->bhd", probs, values), lse


def forward(model, cp_group, variant, input_ids, positions, req_indices, kv_cache):
    """One decode step of an MLA-like layer under DCP (the FULL-graph part): KV append, sharded attention,
    the a2a LSE combine, LM head over rank 0's heads."""
    B = input_ids.shape[0]
    h = model.emb[input_ids] + model.pos[positions]
    q, k, v = ((h @ w).view(B, NUM_HEADS, HEAD_DIM) for w in (model.wq, model.wk, model.wv))
    kv_cache[0, req_indices, positions] = k
    kv_cache[1, req_indices, positions] = v
    keys, values = kv_cache[0, req_indices], kv_cache[1, req_indices]
    out0, lse0 = dcp_local_attention(q, keys, values, positions, dcp_rank=0)
    cp_group.peer = dcp_local_attention(q, keys, values, positions, dcp_rank=1)
    attn = dcp_a2a_lse_reduce(out0, lse0, cp_group, variant)
    return attn.reshape(B, -1) @ model.lm_head


def prefill(model, kv_cache, req, prompt):
    """The prompt's K/V into the request's KV row (eager)."""
    pos = torch.arange(len(prompt), device=kv_cache.device)
    h = model.emb[torch.tensor(prompt, device=kv_cache.device)] + model.pos[pos]
    kv_cache[0, req, pos] = (h @ model.wk).view(-1, NUM_HEADS, HEAD_DIM)
    kv_cache[1, req, pos] = (h @ model.wv).view(-1, NUM_HEADS, HEAD_DIM)


def run(variant: str, device: str = "cpu"):
    global _workspace_manager
    model = Model(device)
    gen = torch.Generator().manual_seed(7)
    step_tokens = [torch.randint(0, VOCAB, (len(reqs),), generator=gen).tolist() for reqs in SCHEDULE]

    def decode_inputs(reqs, tokens, seq_lens):
        pos = [seq_lens[r] for r in reqs]
        for r in reqs:
            seq_lens[r] += 1
        return (torch.tensor(tokens, device=device), torch.tensor(pos, device=device),
                torch.tensor(reqs, device=device))

    def serve(graphed: bool):
        global _workspace_manager
        _workspace_manager = WorkspaceManager(device)          # init_workspace_manager()
        cp_group = GroupCoordinator(DCP_WORLD_SIZE)
        kv_cache = torch.zeros(2, MAX_NUM_REQS + 1, CTX, NUM_HEADS, HEAD_DIM, device=device)
        bufs = {"input_ids": torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device),
                "positions": torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.long, device=device),
                "req_indices": torch.full((MAX_NUM_BATCHED_TOKENS,), DUMMY_REQ, dtype=torch.long, device=device)}

        def step_fn(size):
            return forward(model, cp_group, variant, bufs["input_ids"][:size], bufs["positions"][:size],
                           bufs["req_indices"][:size], kv_cache)

        if graphed:
            events.persistent_state("KV cache", {"kv_cache": kv_cache})
            runner = GraphManager(step_fn, CUDAGRAPH_CAPTURE_SIZES, device=device, num_warmups=1,
                                  static_buffers=bufs, name="GPUModelRunner (FULL decode graphs)")
            runner.capture()
            # Post-capture warmup (kernel warmup / dummy run at max_num_batched_tokens): eager, through the
            # same DCP combine; it needs a bigger workspace than any captured decode size.
            bufs["req_indices"].fill_(DUMMY_REQ)
            with events.warmup():
                step_fn(MAX_NUM_BATCHED_TOKENS)
        kv_cache.zero_()
        for req, prompt in enumerate(PROMPTS):
            prefill(model, kv_cache, req, prompt)
        seq_lens, outs = [len(p) for p in PROMPTS], []
        for reqs, tokens in zip(SCHEDULE, step_tokens):
            ids, pos, req_idx = decode_inputs(reqs, tokens, seq_lens)
            n = len(reqs)
            if not graphed:
                outs.append(forward(model, cp_group, variant, ids, pos, req_idx, kv_cache))
                continue
            size = runner.dispatch(n)
            bufs["input_ids"][:n].copy_(ids)
            bufs["positions"][:n].copy_(pos)
            bufs["req_indices"][:n].copy_(req_idx)
            bufs["req_indices"][n:size].fill_(DUMMY_REQ)
            outs.append(runner.replay(size, real=n).clone())
        _workspace_manager = None
        return outs

    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
    finally:
        _workspace_manager = None
