"""vLLM TurboQuant KV cache with FULL decode graphs (Model Runner V2): the split-K decode scratch (``mid_o`` /
``output`` / ``lse``) is carved out of the growable ``WorkspaceManager`` arena, whose address the FULL graphs bake in;
graphs are captured for ascending batch sizes, so each larger warm-up grows the arena, frees it and unmaps it while
the smaller graphs captured before still point at it, and the first decode replay reads freed memory.

Upstream: https://github.com/vllm-project/vllm/pull/46067 ("[Bugfix][TurboQuant] Fix dangling decode scratch when
workspace grows after cudagraph capture", vllm-project/vllm, by ldkhang1201, opened 2026-06-18, closed; no merge
commit), for issue #45670 ("CUDA error: an illegal memory access was encountered when using turboquant and cuda graph
on GB200"). Read: the PR description (root cause: ``_decode_attention`` sourced ``mid_o``/``output``/``lse`` from the
growable ``WorkspaceManager``; ``WorkspaceManager`` frees and reallocates its buffer when it grows and calls
``empty_cache()``; graphs captured for ascending sizes B=1..max; replaying the B=1 graph dereferences freed memory;
``--enforce-eager`` and ``cudagraph_mode=PIECEWISE`` work), the issue's traceback (``vllm/v1/worker/gpu/
model_runner.py``, the V2 runner), issue #55336's quotation of ``WorkspaceManager._ensure_workspace_size`` (``self.
_current_workspaces[workspace_id] = None; del current_workspace; torch.accelerator.empty_cache(); ... torch.empty(
(required_bytes,), ...)``) and its note that the V2 runner never locks the workspace, and the descriptions of
#40655 / #40706 / #40798 (the per-layer ``_tq_mid_o_buf`` / ``_tq_output_buf`` / ``_tq_lse_buf`` that the workspace
replaced, ``get_simultaneous`` with ``(max_num_reqs, num_heads, max_num_splits, head_size + 1)`` float32 etc.). The
PR's diff itself was not readable here (the vLLM mirror is too large to fetch).
Symptom: serving with ``--kv-cache-dtype turboquant_*`` and CUDA graphs (default ``FULL_AND_PIECEWISE``) dies with
"an illegal memory access" on the first decode step, surfacing at the next synchronising call in ``prepare_inputs``.
Mechanism: ``get_simultaneous`` hands out views of one arena and grows it (free, ``empty_cache``, allocate) when a
request does not fit. The B=1 FULL graph captures decode-attention kernels writing and reading views of the arena
sized for B=1; the warm-up of the B=2 graph asks for more, so the arena is freed and unmapped; the B=1 graph still
holds the old address. Eager decode asks the workspace at every step and always gets live memory.
Doctor: dangling-reference, at _decode_attention. The captured decode attention reads and writes scratch whose
owner (the workspace arena) releases it when a later, larger capture grows the workspace; the fix changes where
``_decode_attention`` takes its scratch from.
Fix (upstream): per the title and root cause, the decode scratch no longer lives in the growable workspace; modelled
as persistent scratch buffers allocated once at the largest batch (``max_num_reqs``) when the attention impl is
built, sliced to the step's batch, so every captured graph points at memory that lives as long as the model.
Modelled: ``WorkspaceManager.get_simultaneous`` / ``_ensure_workspace_size`` (grow = drop, free, ``empty_cache``,
allocate; never locked, as in the V2 runner); ``TurboQuantAttentionImpl.forward`` / ``_decode_attention`` (store of
quantised K/V at ``slot_mapping``, split-K stage 1 into ``mid_o`` with the split's LSE in the last column, stage 2
reduce into ``output`` / ``lse``); the V2 runner's ``capture_model`` (ascending capture sizes, one warm-up each,
one graph pool) and its FULL decode replay with padded requests (``slot_mapping`` -1, ``seq_lens`` 0). Stand-ins:
2 layers, 2 heads of dim 4, 2 KV splits, block size 4; TurboQuant's rotation + Lloyd-Max codebooks are replaced by a
uniform per-token quantiser (keys 8 bits, values 4 bits); no RoPE; prefill stores the prompt's K/V eagerly without
attention; the arena is scaled up so that each size owns its CUDA allocator segment; float64.
Workload: capture sizes 1, 2, 4 (ascending). Requests A, B, C with prompts of 5, 7 and 3 tokens; decode steps [A]
(graph 1), [A, B] (graph 2), [A, B, C] (graph 4, one padded request), [A] (graph 1), greedy. Bug: the first replay
(graph 1) raises IllegalMemoryAccess (graph replay read freed memory: the B=1 workspace arena freed by the B=2
warm-up). Fix: all four steps equal eager (max |graph - eager| = 2e-15: float64 rounding of the padded batch).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/vllm-project/vllm/pull/46067"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_decode_attention"
SYMPTOM = ("TurboQuant KV + FULL CUDA graphs: decode scratch comes from the growable workspace; a larger capture "
           "grows it and frees the arena the smaller graphs captured, so the first decode replay faults")

HIDDEN, VOCAB, NUM_LAYERS = 8, 16, 2
NUM_HEADS, HEAD_DIM = 2, 4
NUM_KV_SPLITS = 2                                  # tq_max_kv_splits_for_cuda_graph
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ = 4, 16, 4
MAX_NUM_REQS = 4
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
KEY_BITS, VALUE_BITS = 8, 4                       # turboquant_k8v4
NULL_BLOCK_ID, PAD_SLOT_ID = 0, -1
DTYPE = torch.float64

_variant = "bug"


# --- vllm/v1/worker/workspace.py -----------------------------------------------------------------------------------------

class WorkspaceManager:
    """One shared scratch arena per ubatch; ``get_simultaneous`` hands out views of it and grows it on demand."""

    def __init__(self, device):
        self.device = device
        self._current_workspaces: list[torch.Tensor | None] = [None]
        self._locked = False                       # the V2 runner never calls lock_workspace()
        # on CUDA each arena size owns its allocator segment, so that empty_cache really unmaps the old one
        self._scale = max(1, own_segment_elems(device) // 64)

    def _ensure_workspace_size(self, required_elems: int, workspace_id: int = 0) -> torch.Tensor:
        required_elems *= self._scale             # the arena's size, in segment-owning units on CUDA
        current_workspace = self._current_workspaces[workspace_id]
        if current_workspace is not None and current_workspace.numel() >= required_elems:
            return current_workspace
        assert not self._locked, "workspace is locked but a larger workspace was requested"
        self._current_workspaces[workspace_id] = None
        del current_workspace
        release_to_driver(self.device)            # torch.accelerator.empty_cache()
        self._current_workspaces[workspace_id] = torch.empty(required_elems, dtype=DTYPE, device=self.device)
        return self._current_workspaces[workspace_id]

    def get_simultaneous(self, *shapes_and_dtypes):
        sizes = [int(torch.Size(shape).numel()) for shape, _ in shapes_and_dtypes]
        workspace = self._ensure_workspace_size(sum(sizes))
        views, offset = [], 0
        for (shape, _), n in zip(shapes_and_dtypes, sizes):
            views.append(workspace[offset: offset + n].view(shape))
            offset += n
        return views


_workspace_manager: WorkspaceManager | None = None


def current_workspace_manager() -> WorkspaceManager:
    assert _workspace_manager is not None
    return _workspace_manager


# --- vllm/v1/attention/ops/triton_turboquant_{store,decode}.py (torch ops over the launch grid) -------------------------

def triton_turboquant_store(x, cache, scale_cache, slot_mapping, bits):
    """Quantise each token per head (uniform stand-in for rotation + Lloyd-Max) and store it at its slot; padded
    tokens (slot -1) go to the null block."""
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=-1).clamp(min=1e-6) / qmax                      # [T, H]
    q = torch.round(x / scale[..., None]).clamp(-qmax, qmax)
    slot = torch.where(slot_mapping >= 0, slot_mapping, NULL_BLOCK_ID * BLOCK_SIZE).long()
    cache.view(-1, NUM_HEADS, HEAD_DIM).index_copy_(0, slot, q)
    scale_cache.view(-1, NUM_HEADS).index_copy_(0, slot, scale)


def _dequant(cache, scale_cache, block_table):
    B = block_table.shape[0]
    blocks = block_table.long().clamp(min=0)
    x = cache[blocks] * scale_cache[blocks][..., None]                        # [B, nb, bs, H, D]
    return x.reshape(B, MAX_BLOCKS_PER_REQ * BLOCK_SIZE, NUM_HEADS, HEAD_DIM)


def _tq_decode_stage1(q, k, v, seq_lens, mid_o, sm_scale):
    """grid = (B, H, NUM_KV_SPLITS): each split writes its normalised partial output and its LSE (last column)."""
    L = k.shape[1]
    chunk = L // NUM_KV_SPLITS
    pos = torch.arange(L, device=q.device)
    scores = torch.einsum("bhd,blhd->bhl", q, k) * sm_scale                   # [B, H, L]
    for s in range(NUM_KV_SPLITS):
        in_split = (pos >= s * chunk) & (pos < (s + 1) * chunk)
        mask = (in_split[None, :] & (pos[None, :] < seq_lens[:, None].long()))[:, None, :]   # [B, 1, L]
        has = mask.any(dim=-1)                                                # [B, 1]
        sc = scores.masked_fill(~mask, float("-inf"))
        m = torch.where(has, sc.amax(dim=-1), torch.zeros_like(sc[..., 0]))
        p = torch.exp(sc - m[..., None]).masked_fill(~mask, 0.0)
        l_sum = p.sum(dim=-1)
        o = torch.einsum("bhl,blhd->bhd", p, v) / l_sum.clamp(min=1e-30)[..., None]
        mid_o[:, :, s, :HEAD_DIM].copy_(o)
        mid_o[:, :, s, HEAD_DIM].copy_(torch.where(has, m + torch.log(l_sum.clamp(min=1e-30)), float("-inf")))


def _tq_decode_stage2(mid_o, output, lse):
    """grid = (B, H): reduce the splits by their LSEs."""
    split_lse = mid_o[..., HEAD_DIM]                                          # [B, H, S]
    finite = torch.isfinite(split_lse)
    m = torch.where(finite, split_lse, -1e30).amax(dim=-1)
    w = torch.where(finite, torch.exp(split_lse - m[..., None]), 0.0)
    denom = w.sum(dim=-1)
    output.copy_((w[..., None] * mid_o[..., :HEAD_DIM]).sum(dim=2) / denom.clamp(min=1e-30)[..., None])
    lse.copy_(m + torch.log(denom.clamp(min=1e-30)))


# --- vllm/v1/attention/backends/turboquant_attn.py -----------------------------------------------------------------------

class TurboQuantAttentionImpl:
    def __init__(self, device):
        self.scale = HEAD_DIM ** -0.5
        if _variant == "fix":                       # scratch at an address that never moves, sized for the max batch
            self._tq_mid_o_buf = torch.empty(MAX_NUM_REQS, NUM_HEADS, NUM_KV_SPLITS, HEAD_DIM + 1, dtype=DTYPE,
                                             device=device)
            self._tq_output_buf = torch.empty(MAX_NUM_REQS, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
            self._tq_lse_buf = torch.empty(MAX_NUM_REQS, NUM_HEADS, dtype=DTYPE, device=device)

    def forward(self, layer, q, k, v, attn_metadata, output):
        triton_turboquant_store(k, layer.k_cache, layer.k_scale, attn_metadata.slot_mapping, KEY_BITS)
        triton_turboquant_store(v, layer.v_cache, layer.v_scale, attn_metadata.slot_mapping, VALUE_BITS)
        output.copy_(self._decode_attention(layer, q, attn_metadata))
        return output

    def _decode_attention(self, layer, q, attn_metadata):
        B = q.shape[0]
        if _variant == "bug":
            mid_o, out, lse = current_workspace_manager().get_simultaneous(
                ((B, NUM_HEADS, NUM_KV_SPLITS, HEAD_DIM + 1), DTYPE),
                ((B, NUM_HEADS, HEAD_DIM), DTYPE),
                ((B, NUM_HEADS), DTYPE),
            )
        else:
            mid_o, out, lse = self._tq_mid_o_buf[:B], self._tq_output_buf[:B], self._tq_lse_buf[:B]
        k = _dequant(layer.k_cache, layer.k_scale, attn_metadata.block_table)
        v = _dequant(layer.v_cache, layer.v_scale, attn_metadata.block_table)
        _tq_decode_stage1(q, k, v, attn_metadata.seq_lens, mid_o, self.scale)
        _tq_decode_stage2(mid_o, out, lse)
        return out


class TurboQuantMetadata:
    def __init__(self, slot_mapping, block_table, seq_lens):
        self.slot_mapping, self.block_table, self.seq_lens = slot_mapping, block_table, seq_lens


# --- the model (2 decoder layers, TurboQuant attention) -----------------------------------------------------------------

class Layer:
    def __init__(self, gen, device):
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.6).to(DTYPE)  # noqa: E731
        self.qkv, self.o_proj, self.mlp = r(HIDDEN, 3 * NUM_HEADS * HEAD_DIM), r(NUM_HEADS * HEAD_DIM, HIDDEN), r(
            HIDDEN, HIDDEN)
        z = lambda *s: torch.zeros(*s, dtype=DTYPE, device=device)              # noqa: E731
        self.k_cache, self.v_cache = z(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), z(
            NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
        self.k_scale, self.v_scale = z(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS), z(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS)
        self.impl = TurboQuantAttentionImpl(device)

    def kv(self, h):
        q, k, v = (F.rms_norm(h, (HIDDEN,)) @ self.qkv).view(-1, 3, NUM_HEADS, HEAD_DIM).unbind(1)
        return q, k, v

    def forward(self, h, md):
        q, k, v = self.kv(h)
        attn = torch.empty_like(q)
        self.impl.forward(self, q, k, v, md, attn)
        h = h + attn.reshape(h.shape[0], -1) @ self.o_proj
        return h + torch.tanh(F.rms_norm(h, (HIDDEN,)) @ self.mlp)


class Model:
    def __init__(self, device):
        gen = generator(46067)
        self.embed = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.layers = [Layer(gen, device) for _ in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device).to(DTYPE)

    def forward(self, input_ids, md):
        h = self.embed[input_ids]
        for layer in self.layers:
            h = layer.forward(h, md)
        return F.rms_norm(h, (HIDDEN,)) @ self.lm_head


# --- vllm/v1/worker/gpu/model_runner.py + cudagraph_utils.py (V2 runner, decode only) -----------------------------------

class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        global _workspace_manager
        _workspace_manager = WorkspaceManager(device)
        self.device = device
        self.model = Model(device)
        self.input_ids = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((MAX_NUM_REQS,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
        self.requests, self.graphs, self.next_block = {}, {}, 1
        if use_cuda_graph:
            self.capture_model()

    def _metadata(self, n):
        return TurboQuantMetadata(self.slot_mapping[:n], self.block_table[:n], self.seq_lens[:n])

    def _run(self, n):
        return self.model.forward(self.input_ids[:n], self._metadata(n))

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES):                      # ascending, as the V2 runner captures
            self.input_ids[:size].fill_(0)
            self.slot_mapping[:size].fill_(PAD_SLOT_ID)
            self.block_table[:size].fill_(NULL_BLOCK_ID)
            self.seq_lens[:size].fill_(1)
            self.graphs[size] = capture(
                lambda n=size: self._run(n), device=self.device, pool=pool, warmups=1,
                name=f"FULL decode [{size}]", owner="GPUModelRunner",
                static={"input_ids": self.input_ids, "slot_mapping": self.slot_mapping,
                        "block_table": self.block_table, "seq_lens": self.seq_lens},
                state={f"layer{i}.{c}": getattr(layer, c) for i, layer in enumerate(self.model.layers)
                       for c in ("k_cache", "v_cache", "k_scale", "v_scale")})

    def add_request(self, req_id, prompt):
        blocks = list(range(self.next_block, self.next_block + MAX_BLOCKS_PER_REQ))
        self.next_block += MAX_BLOCKS_PER_REQ
        req = {"tokens": list(prompt), "blocks": blocks}
        self.requests[req_id] = req
        slots = torch.tensor([blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(len(prompt))],
                             device=self.device)
        h = self.model.embed[torch.tensor(prompt, device=self.device)]         # prefill: store K/V only
        for layer in self.model.layers:
            _, k, v = layer.kv(h)
            triton_turboquant_store(k, layer.k_cache, layer.k_scale, slots, KEY_BITS)
            triton_turboquant_store(v, layer.v_cache, layer.v_scale, slots, VALUE_BITS)

    def execute_model(self, req_ids):
        n = len(req_ids)
        size = next((s for s in sorted(self.graphs) if s >= n), n)
        for row, req_id in enumerate(req_ids):
            req = self.requests[req_id]
            pos = len(req["tokens"])
            self.input_ids[row] = req["tokens"][-1]
            self.slot_mapping[row] = req["blocks"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.block_table[row] = torch.tensor(req["blocks"], dtype=torch.int32)
            self.seq_lens[row] = pos + 1
        self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
        self.block_table[n:size].fill_(NULL_BLOCK_ID)
        self.seq_lens[n:size].fill_(0)
        if size in self.graphs:
            g, out = self.graphs[size]
            logits = replay(g, out, real=n, size=size)[:n].clone()
        else:
            logits = self._run(n)[:n].clone()
        for row, req_id in enumerate(req_ids):
            self.requests[req_id]["tokens"].append(int(logits[row].argmax()))
        return logits


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    prompts = {"A": [3, 1, 4, 1, 5], "B": [9, 2, 6, 5, 3, 5, 8], "C": [7, 11, 13]}
    steps = [["A"], ["A", "B"], ["A", "B", "C"], ["A"]]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        for req_id, prompt in prompts.items():
            runner.add_request(req_id, prompt)
        return [runner.execute_model(step) for step in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
