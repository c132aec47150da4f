"""Cake Sage attention's captured launch reads its TMA descriptors from a caller-owned workspace slot; an eager call with other tensors rebinds the slot, and later replays attend through the eager call's descriptors.

Upstream: https://github.com/flashinfer-ai/flashinfer/pull/5127 ("fix(cake_sage_attn): cover Sage combinations and
pass tensor maps by value", flashinfer-ai/flashinfer, merged; opened 2026-09-11). The bug came in with
https://github.com/flashinfer-ai/flashinfer/pull/5083 ("fix(cake_sage_attention): support non-contiguous Sage
attention with partial KV tiles", merged 2026-09-10).
Symptom: ``bsa_attn_sm120_blk64_sage_fwd(..., backend="cake")`` (SM120 Sage block-sparse attention) inside a CUDA
graph gives silently wrong attention once an eager call with other tensors has used the same
``tma_descriptor_workspace`` between replays. The replay reads and writes the eager call's tensors, not its own.
If the eager call's tensors have been freed, it gets a CUDA fault instead. The PR: "overwriting or recycling that storage could cause a
CUDA fault or silently access the wrong tensors". Its regression list includes "interleaved graph replay and
eager bindings". Without graphs every call is right.
Mechanism: in the generated SM120 binding (``csrc/cake_sage_block_sparse_attention/sm_120a/
cake_sage_block_sparse_attention_<hash>_binding.cu``), ``Run`` encodes the four ``CUtensorMap``s (``EncodeTma_Q_map``
.. ``EncodeTma_O_map``, each holding its tensor's global address, dims and strides). It passes the kernel
``CakeTensorMap const*`` pointers from ``CallerTmaWorkspaceSlot(tm, tma_descriptor_workspace, slot, stream)``: slot
``i`` is ``workspace.data_ptr() + i * sizeof(CUtensorMap)``. ``CallerTmaWorkspaceSlot`` keeps a process-wide
``static std::unordered_map descriptor_by_slot`` from (context, workspace address, slot) to the bound bytes. On a
hit it returns the slot address and uploads nothing. On a miss it refuses under capture ("warm the exact tensors
before CUDA Graph capture") and otherwise ``cuMemcpyHtoD``s the new descriptor into the slot ("Stable descriptor
bytes are uploaded once before capture and reused by warm launches"). So the warmup uploads the captured binding's
descriptors, the capture hits the cache and records only the slot addresses, and each replay has the kernel load
whatever descriptors the slots hold at that moment. An eager launch with another binding on the same workspace (a
shape the runner did not capture) misses the cache and rewrites all four slots. Every later replay then loads Q/K/V
through the eager call's tensor maps and stores O through its O map. The graph's own output buffer keeps the value
from the replay before. An eager re-run of the captured step would miss the cache and re-upload its own
descriptors, so eager is right.
Doctor: warmup-divergence, at CallerTmaWorkspaceSlot. The descriptors were uploaded once, by the warmup. The
capture decided from the ``descriptor_by_slot`` hit to skip the upload and hand the kernel a reference to the shared
slot, and every replay reuses that decision. After an eager binding rebinds the slot, the eager form of the same
step decides otherwise: it gets a cache miss and re-uploads. The fix removed this helper's slot cache and upload.
Fix (upstream): all four tensor maps are passed by value as ``const __grid_constant__ CUtensorMap`` kernel
parameters. Every eager launch and every captured node owns its descriptor bytes. Attention needs no descriptor
workspace, cache or upload kernel. ``tma_descriptor_workspace`` stays in the Python API, accepted but unused (an
empty tensor is enough). The PR also grows the SM120 export from 7 to 25 specializations. That part is not modelled.
Modelled: one DiT-style attention block: Q/K/V projections, Sage block-sparse attention and an output projection
with a residual. The caller is shaped like vLLM-Omni's Sage adapter plus a graph runner. It owns one descriptor
workspace for all calls. For the captured token count it keeps persistent caller-owned Q/K/V/O bindings, because
the pre-fix binding needs "the exact tensors" warmed before capture. Any other token count runs eagerly on fresh
temporaries. Sizes are scaled: head_dim 4, 4-token blocks (64 upstream), B = 1, two heads. Sage quantization is
left out (the "int8/fp8" operands hold float32). V is BHSD, not HDS. Device global memory, which a tensor map
addresses, is one arena ``GMEM`` with a bump allocator. A tensor's address is its element offset in it. Nothing is
reused in this short run, so the stale maps find the eager call's tensors intact (the regression test's
"stale valid descriptor" case). A ``CUtensorMap`` is 16 int64 words (128 B): base address, four dims and the
three strides derived from them. The workspace is 64 int64 (512 B, four slots). The kernel's TMA loads and stores
are gathers and scatters on the arena.
"""
from __future__ import annotations

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/flashinfer-ai/flashinfer/pull/5127"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "CallerTmaWorkspaceSlot"
SYMPTOM = ("after an eager Sage attention call with other tensors, replays load Q/K/V and store O through the "
           "eager call's TMA descriptors left in the shared workspace slots")

HEADS, HEAD_DIM = 2, 4                # upstream head_dim 128
HIDDEN = HEADS * HEAD_DIM
BLOCK = 4                             # _BLOCK_SIZE (64 upstream)
CAPTURED_TOKENS = 8                   # the runner's captured size
GMEM_ELEMS = 4096
CUTENSORMAP_WORDS = 16                # sizeof(CUtensorMap) == 128 B == 16 int64
TMA_WORKSPACE_BYTES = 512             # four slots: Q, K, V, O

# ---- device global memory: what a tensor map's global address points into ----------------------------------

GMEM: dict[str, torch.Tensor] = {}
GMEM_DEVICE: list[str] = ["cpu"]        # the device whose arena the kernels address
_gmem_top: dict[str, int] = {}


def cuda_empty(shape, device: str) -> torch.Tensor:
    """A caching-allocator block as a view of the device arena (bump allocation; nothing reused here)."""
    n = 1
    for s in shape:
        n *= s
    top = _gmem_top[device]
    assert top + n <= GMEM_ELEMS, "device arena exhausted"
    _gmem_top[device] = top + n
    return GMEM[device][top:top + n].view(*shape)


def _address(t: torch.Tensor) -> int:
    return t.storage_offset()          # element address in GMEM


# ---- csrc/cake_sage_block_sparse_attention/sm_120a/..._binding.cu (tvm-ffi host shim) --------------------------

# static std::unordered_map<std::string, std::string>* descriptor_by_slot (process lifetime)
descriptor_by_slot: dict[tuple[int, int], tuple[int, ...]] = {}


def EncodeTma_map(t: torch.Tensor) -> tuple[int, ...]:
    """cuTensorMapEncodeTiled for a 4D BHSD operand: global address, dims (innermost first) and the strides the
    generated encoder derives from those dims."""
    d4, d3, d2, d1 = (int(s) for s in t.shape)
    words = [_address(t), d1, d2, d3, d4, d1, d2 * d1, d3 * d2 * d1]
    return tuple(words + [0] * (CUTENSORMAP_WORDS - len(words)))


def CallerTmaWorkspaceSlot(tm: tuple[int, ...], workspace: torch.Tensor, slot: int) -> torch.Tensor:
    """Upload one encoded tensor map into a caller-owned slot, once; return the slot (``CakeTensorMap const*``).
    Stable descriptor bytes are uploaded once before capture and reused by warm launches."""
    address = workspace[slot * CUTENSORMAP_WORDS:(slot + 1) * CUTENSORMAP_WORDS]
    key = (workspace.data_ptr(), slot)
    if descriptor_by_slot.get(key) == tm:
        return address                                     # warm binding: no upload, just the slot address
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("caller-owned pointer TMA workspace is not prepared for this tensor binding; "
                           "warm the exact tensors before CUDA Graph capture")
    address.copy_(torch.tensor(tm, dtype=torch.int64, device=workspace.device))   # cuMemcpyHtoD
    descriptor_by_slot[key] = tm
    return address


def _tma_box_index(tm, batch: int, heads: int, rows: int, cols: int) -> torch.Tensor:
    """The GMEM element index of each box element. ``tm`` is the map itself (by value: kernel-parameter
    constants) or a slot pointer whose words the kernel loads from device memory."""
    base, s1, s2, s3 = tm[0], tm[5], tm[6], tm[7]
    dev = GMEM_DEVICE[0]
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    r = torch.arange(rows, device=dev).view(1, 1, -1, 1)
    c = torch.arange(cols, device=dev).view(1, 1, 1, -1)
    return base + b * s3 + h * s2 + r * s1 + c



def kernel_cake_sage_block_sparse_attention(Q_map, K_map, V_map, O_map, q2k_block_index, seqlen_q: int,
                                            seqlen_k: int, num_heads: int, block_sparse_num: int,
                                            softmax_scale: float):
    gmem = GMEM[GMEM_DEVICE[0]]
    batch = q2k_block_index.shape[0]
    q = gmem[_tma_box_index(Q_map, batch, num_heads, seqlen_q, HEAD_DIM)]       # TMA loads
    k = gmem[_tma_box_index(K_map, batch, num_heads, seqlen_k, HEAD_DIM)]
    v = gmem[_tma_box_index(V_map, batch, num_heads, seqlen_k, HEAD_DIM)]
    dev = q.device
    # block-sparse selection: q block i attends the first block_sparse_num KV blocks of q2k_block_index[..., i, :]
    sel = q2k_block_index[..., :block_sparse_num].long()                        # [B, H, QB, n]
    kv_blocks = torch.arange((seqlen_k + BLOCK - 1) // BLOCK, device=dev)
    allowed = (sel.unsqueeze(-1) == kv_blocks).any(-2)                          # [B, H, QB, KB]
    q_blk = torch.arange(seqlen_q, device=dev) // BLOCK
    k_blk = torch.arange(seqlen_k, device=dev) // BLOCK
    mask = allowed[:, :, q_blk][:, :, :, k_blk]                                 # [B, H, Sq, Sk]
    scores = (q @ k.transpose(-1, -2)) * softmax_scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    o = probs @ v
    o_index = _tma_box_index(O_map, batch, num_heads, seqlen_q, HEAD_DIM)
    gmem.index_put_((o_index.reshape(-1),), o.reshape(-1))                      # TMA store


def Run(variant, arg_Q_map, arg_K_map, arg_V_map, arg_O_map, arg_q2k_block_index, arg_seqlen_q, arg_seqlen_k,
        arg_num_heads, arg_block_sparse_num, arg_softmax_scale, arg_tma_descriptor_workspace):
    h_Q_map = EncodeTma_map(arg_Q_map)
    h_K_map = EncodeTma_map(arg_K_map)
    h_V_map = EncodeTma_map(arg_V_map)
    h_O_map = EncodeTma_map(arg_O_map)
    if variant == "bug":
        # CakeTensorMap const* p_X_map = CallerTmaWorkspaceSlot(h_X_map, workspace, slot, stream)
        maps = [CallerTmaWorkspaceSlot(tm, arg_tma_descriptor_workspace, slot)
                for slot, tm in enumerate((h_Q_map, h_K_map, h_V_map, h_O_map))]
    else:
        # const __grid_constant__ CUtensorMap: the bytes travel in the launch (and in the graph node)
        maps = [h_Q_map, h_K_map, h_V_map, h_O_map]
    kernel_cake_sage_block_sparse_attention(*maps, arg_q2k_block_index, arg_seqlen_q, arg_seqlen_k, arg_num_heads,
                                            arg_block_sparse_num, arg_softmax_scale)


# ---- flashinfer/cute_dsl/sparse/bsa_attn_sm120.py ---------------------------------------------------------------

def bsa_attn_sm120_blk64_sage_fwd(q_int8, k_int8, v_fp8, q2k_block_index, block_sparse_num, softmax_scale=None, *,
                                  out, tma_descriptor_workspace, variant):
    batch, heads, seqlen_q, head_dim = q_int8.shape
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    Run(variant, q_int8, k_int8, v_fp8, out, q2k_block_index, seqlen_q, k_int8.shape[2], heads, block_sparse_num,
        float(softmax_scale), tma_descriptor_workspace)
    return out


# ---- the caller: a Sage attention block and its graph runner ------------------------------------------------------

def _q2k_block_index(tokens: int, device: str) -> torch.Tensor:
    """Each q block attends itself and the next KV block (capacity 2)."""
    nb = (tokens + BLOCK - 1) // BLOCK
    idx = [[i, (i + 1) % nb] for i in range(nb)]
    return torch.tensor(idx, dtype=torch.int32, device=device).expand(1, HEADS, nb, 2).contiguous()


class SageAttentionBinding:
    """The caller-owned Sage operands of one token count: quantized Q/K/V, output, sparse layout."""

    def __init__(self, tokens: int, device: str):
        shape = (1, HEADS, tokens, HEAD_DIM)
        self.q_int8, self.k_int8, self.v_fp8, self.out = (cuda_empty(shape, device) for _ in range(4))
        self.q2k_block_index = _q2k_block_index(tokens, device)


class SageDiTAttention:
    def __init__(self, device: str, variant: str):
        gen = generator(5127)
        self.wq, self.wk, self.wv, self.wo = (randn(HIDDEN, HIDDEN, gen=gen, device=device, scale=0.5)
                                              for _ in range(4))
        self.device, self.variant = device, variant
        self.tma_descriptor_workspace = torch.zeros(TMA_WORKSPACE_BYTES // 8, dtype=torch.int64, device=device)
        # the exact tensors the pre-fix binding needs warmed before capture: persistent for the captured size
        self.bindings = {CAPTURED_TOKENS: SageAttentionBinding(CAPTURED_TOKENS, device)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        b = self.bindings.get(tokens) or SageAttentionBinding(tokens, self.device)   # else: eager temporaries
        to_bhsd = lambda t: t.view(tokens, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)  # noqa: E731
        b.q_int8.copy_(to_bhsd(x @ self.wq))          # (Sage quantization left out)
        b.k_int8.copy_(to_bhsd(x @ self.wk))
        b.v_fp8.copy_(to_bhsd(x @ self.wv))
        out = bsa_attn_sm120_blk64_sage_fwd(b.q_int8, b.k_int8, b.v_fp8, b.q2k_block_index, 2, out=b.out,
                                            tma_descriptor_workspace=self.tma_descriptor_workspace,
                                            variant=self.variant)
        attn = out[0].transpose(0, 1).reshape(tokens, HIDDEN)
        return x + attn @ self.wo


def _fresh_process(device: str) -> None:
    GMEM[device] = torch.zeros(GMEM_ELEMS, device=device)
    _gmem_top[device] = 0
    GMEM_DEVICE[0] = device
    descriptor_by_slot.clear()


def run(variant: str, device: str = "cpu"):
    gen = generator(50830)
    token_counts = [8, 8, 12, 8, 8]            # a 12-token request: a shape the runner did not capture
    inputs = [randn(n, HIDDEN, gen=gen, device=device) for n in token_counts]

    def eager():
        _fresh_process(device)
        block = SageDiTAttention(device, variant)
        return [block.forward(x).clone() for x in inputs]

    def served():
        _fresh_process(device)
        block = SageDiTAttention(device, variant)
        static_input = torch.zeros(CAPTURED_TOKENS, HIDDEN, device=device)
        g, out = capture(lambda: block.forward(static_input), device=device, warmups=1, name="sage block",
                         owner="SageGraphRunner", static={"hidden_states": static_input})
        outs = []
        for x in inputs:
            if x.shape[0] == CAPTURED_TOKENS:
                static_input.copy_(x)
                outs.append(replay(g, out).clone())
            else:
                outs.append(block.forward(x).clone())             # eager fallback, same workspace
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
