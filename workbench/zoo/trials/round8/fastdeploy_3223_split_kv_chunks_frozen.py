"""Decode attention's split-KV chunk count is decided on the host at capture: replays keep the capture's.

Upstream: https://github.com/PaddlePaddle/FastDeploy/pull/3223 ("[Executor] Fixed the issue of CUDA graph
execution failure caused by different branches during decoding"; earlier attempts #3086, #3104).
Symptom: with CUDA graphs on, decoding long sequences (longer than the attention's partition size) gave
CUDA error 700 or garbled output (``<unk>`` tokens); eager decoding was fine (FastDeploy, Aug 2025).
Mechanism: ``MultiQueryAppendAttention``'s host code reads the batch's longest decoder length
(``max_dec_len``, from the host copy ``max_len_tensor_cpu``) and sets ``num_chunks = div_up(max_dec_len,
chunk_size)``, which picks the kernel branch (``num_chunks <= 1``: no split, no merge) and the launch grid
and workspace of the split branch. A decode graph captured on the dummy run's short sequences records one
chunk and the no-split branch. Replays of long sequences run only that chunk: keys past the first
partition are never attended, while eager decoding splits and merges over all of them.
Doctor: host-work-frozen, at ``MultiQueryAppendAttention`` (the host-side ``num_chunks`` that sizes the
launch and picks the branch).
Fix (upstream): always take the split-KV branch (``num_chunks <= 0`` for the no-split one) and size the
launch from the largest possible length (``div_up(max_seq_len, chunk_size)``, ``max_seq_len`` =
``max_model_len``) instead of this batch's; chunks beyond a sequence's length return at once on device.
"""
from __future__ import annotations

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events, host
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/PaddlePaddle/FastDeploy/pull/3223"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "MultiQueryAppendAttention"
SYMPTOM = "long sequences decoded by the graph attend over the first KV partition only (garbled tokens)"
VOCAB, DIM, BLOCK, BS = 11, 4, 2, 2
MAX_SEQ = 12                        # max_model_len
CHUNK = 4                           # max_partition_size
MAX_BLOCKS = MAX_SEQ // BLOCK
SLOTS = (BS * MAX_BLOCKS + 1) * BLOCK


def div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


class Model:
    def __init__(self, device):
        gen = generator(3223)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_SEQ, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv = (randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(3))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)

    def qkv(self, ids, positions):
        h = self.emb[ids] + self.pos[positions]
        return h @ self.wq, h @ self.wk, h @ self.wv


def MultiQueryAppendAttention(q, k_cache, v_cache, block_table, seq_lens_kv, max_dec_len: int, fixed: bool):
    """Decode attention over the paged cache, split along the keys into ``num_chunks`` partitions of
    ``CHUNK`` keys (per-chunk partial softmax in a workspace, then a merge)."""
    if fixed:
        num_chunks = div_up(MAX_SEQ, CHUNK)                  # the largest length any batch can have
    else:
        num_chunks = div_up(max_dec_len, CHUNK)              # this batch's longest sequence (host value)
    pos = torch.arange(num_chunks * CHUNK, device=q.device)
    slots = block_table[:, (pos // BLOCK).clamp(max=MAX_BLOCKS - 1)] * BLOCK + pos % BLOCK
    scores = (q[:, None, :] * k_cache[slots]).sum(-1) / DIM ** 0.5           # [bs, num_chunks * CHUNK]
    scores = scores.masked_fill(pos[None, :] >= seq_lens_kv[:, None], float("-inf"))
    v = v_cache[slots]
    if not fixed and num_chunks <= 1:                         # nosplit_kv_kernel: writes out directly
        return (torch.softmax(scores, -1)[..., None] * v).sum(1)
    # split_kv_kernel: one partial result per chunk (tmp_workspace, tmp_m, tmp_d) ...
    s = scores.view(-1, num_chunks, CHUNK)
    m = s.amax(-1).clamp(min=-1e30)                                            # empty chunks: no keys
    p = torch.exp(s - m[..., None])
    d = p.sum(-1)
    o = (p[..., None] * v.view(-1, num_chunks, CHUNK, DIM)).sum(2)
    # ... merge_multi_chunks_decoder_kernel: rescale the partials to the global max and normalise
    g = m.amax(-1, keepdim=True)
    w = torch.exp(m - g)
    return (o * w[..., None]).sum(1) / (d * w).sum(-1, keepdim=True)


def prefill(model, k_cache, v_cache, prompt, blocks):
    pos = torch.arange(len(prompt), device=k_cache.device)
    slots = torch.tensor(blocks, device=k_cache.device)[pos // BLOCK] * BLOCK + pos % BLOCK
    _, k, v = model.qkv(torch.tensor(prompt, device=k_cache.device), pos)
    k_cache[slots] = k
    v_cache[slots] = v


def requests():
    """Two requests (prompts of 5 and 3 tokens) on blocks of their own, decoded for 3 steps: their
    lengths reach 6..8 and 4..6 keys, past the 4-key partition."""
    return [([3, 7, 1, 9, 4], [0, 1, 2, 3, 4, 5]), ([5, 2, 8], [6, 7, 8, 9, 10, 11])]


def decode_steps(device):
    steps = []
    for step in range(3):
        ids, positions, slots, lens = [], [], [], []
        for i, (prompt, blocks) in enumerate(requests()):
            p = len(prompt) + step
            ids.append((prompt[-1] + 3 * step + i) % VOCAB)
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
            lens.append(p + 1)
        steps.append((torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                      torch.tensor(slots, device=device), torch.tensor(lens, device=device)))
    return steps


def run(variant: str, device: str = "cpu"):
    model = Model(device)
    fixed = variant == "fix"
    tables = torch.tensor([blocks for _, blocks in requests()], device=device)

    def serve(graphed: bool):
        k_cache = torch.zeros(SLOTS, DIM, device=device)
        v_cache = torch.zeros(SLOTS, DIM, device=device)
        # share_inputs: persistent input buffers of the decode graphs, and the host copy of the batch's
        # maximum lengths that get_block_shape_and_split_kv_block fills before every forward
        bufs = {"input_ids": torch.zeros(BS, dtype=torch.long, device=device),
                "position_ids": torch.zeros(BS, dtype=torch.long, device=device),
                "slot_mapping": torch.full((BS,), SLOTS - 1, dtype=torch.long, device=device),
                "block_tables": torch.full((BS, MAX_BLOCKS), BS * MAX_BLOCKS, dtype=torch.long, device=device),
                "seq_lens_decoder": torch.ones(BS, dtype=torch.long, device=device)}
        max_len_tensor_cpu = host(torch.ones(1, dtype=torch.int32), device)

        def forward(size: int):
            q, k, v = model.qkv(bufs["input_ids"][:size], bufs["position_ids"][:size])
            k_cache[bufs["slot_mapping"][:size]] = k               # decoder_write_cache_with_rope
            v_cache[bufs["slot_mapping"][:size]] = v
            max_dec_len = int(max_len_tensor_cpu[0])
            attn = MultiQueryAppendAttention(q, k_cache, v_cache, bufs["block_tables"][:size],
                                             bufs["seq_lens_decoder"][:size], max_dec_len, fixed)
            return attn @ model.lm_head

        manager = GraphManager(forward, [BS], device=device, static_buffers=bufs,
                               mode=CUDAGraphMode.FULL if graphed else CUDAGraphMode.NONE,
                               name="GPUModelRunner decode graphs")
        events.persistent_state("GPUModelRunner", {"k_cache": k_cache, "v_cache": v_cache})
        manager.capture()                                   # capture_model(): dummy decode of 1-key sequences
        for prompt, blocks in requests():                   # then requests arrive: eager prefill
            prefill(model, k_cache, v_cache, prompt, blocks)
        outs = []
        for ids, positions, slots, lens in decode_steps(device):
            bufs["input_ids"].copy_(ids)
            bufs["position_ids"].copy_(positions)
            bufs["slot_mapping"].copy_(slots)
            bufs["block_tables"].copy_(tables)
            bufs["seq_lens_decoder"].copy_(lens)
            max_len_tensor_cpu[0] = int(lens.max())         # get_block_shape_and_split_kv_block
            size = manager.dispatch(BS)
            out = manager.run_eager(BS) if size is None else manager.replay(size, BS)
            outs.append(out.clone())
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
