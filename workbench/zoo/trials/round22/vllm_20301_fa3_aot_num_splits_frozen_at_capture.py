"""FA3 AoT scheduling under a FULL decode graph: the split count the capture chose is not the one the schedule asks for.

Upstream: https://github.com/vllm-project/vllm/pull/20301 ("[CUDA graphs] Enable full cuda graphs with FA3 AoT
scheduling"); the same contract is tightened by https://github.com/vllm-project/vllm/pull/25490 ("[BugFix]
Potential Fix for FA3 full-cudagraph IMA": ``get_scheduler_metadata`` and ``FlashAttentionMetadata`` must get
the same ``max_num_splits``).
Symptom: with ``full_cuda_graph`` and FlashAttention 3's ahead-of-time (AoT) scheduler, decode steps hit an
illegal memory access "when the run-time split factor is larger than ``num_splits`` set by internal heuristics
at capture-time"; vLLM had to switch AoT scheduling off under full CUDA graphs (V1, mid 2025).
Mechanism: ``FlashAttentionMetadataBuilder.build`` runs ``get_scheduler_metadata`` outside the graph, every
step, and copies its per-request split counts (``num_splits_dynamic``) into the persistent
``scheduler_metadata`` buffer. With ``num_splits=0`` both it and the kernel's host code pick the split count
with FA's ``num_splits_heuristic``, from the batch size and ``max_seqlen_k``. Eagerly the two agree. Under a
FULL graph the kernel's host code ran once, at capture: the dummy batch (4 requests of ``max_model_len``
tokens) gave 2 splits, which fixed the launch grid and the split accumulators. At run time the metadata is
built for the real, unpadded batch (padding comes after metadata building): two requests, or one, leave SMs
idle, so the heuristic asks for 4 or 6 splits of their KV. The replay still launches 2: the splits past
the grid are never computed (upstream they also wrote accumulators the capture never allocated: the IMA). Here
the combine therefore sees only the first splits' keys, and long-context decode rows come out wrong.
Doctor: warmup-divergence, at ``flash_attn_varlen_func`` (its host code chose ``num_splits`` from the capture
batch; replays keep that launch while an eager step, and the schedule, choose more).
Fix (upstream): when the step runs under a full CUDA graph (``num_actual_tokens <= max_cudagraph_size``) the
builder sets ``max_num_splits = _DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH`` and passes it both to
``get_scheduler_metadata(num_splits=...)`` and, through ``FlashAttentionMetadata.max_num_splits``, to
``flash_attn_varlen_func(num_splits=...)``: capture launches the upper bound and the schedule never exceeds it.
(Only the PR descriptions and review threads were read, not the full diff; FA3's host heuristic is modelled
after ``num_splits_heuristic`` in flash-attention's ``heuristics.h``, with tiny sizes: 8 SMs, 4-key blocks.)
"""
from __future__ import annotations

import enum
import math
from types import SimpleNamespace

import torch

from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/20301"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "flash_attn_varlen_func"
SYMPTOM = "FULL decode graph with FA3 AoT scheduling: run-time split factor exceeds the captured one (IMA upstream)"

VOCAB, DIM, MAX_MODEL_LEN = 16, 8, 32
MAX_NUM_REQS = 4
CAPTURE_SIZES = [4]                        # one FULL decode graph: 4 requests, one token each
NUM_SMS, KBLOCK_N, KBLOCK_M = 8, 4, 4      # FA3 tile sizes (scaled down), SM count of the "GPU"
MAX_SPLITS = 128
_DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH = 8
PAD_ROW = MAX_NUM_REQS                     # KV rows: one per request slot, plus one for padded tokens
PAD_SLOT = PAD_ROW * MAX_MODEL_LEN

_forward_context = SimpleNamespace(attn_metadata=None)


def get_forward_context():
    return _forward_context


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3


def cdiv(a, b):
    return -(-a // b)


def num_splits_heuristic(total_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash-attention's host heuristic: split the KV only when the batch leaves SMs idle."""
    if total_mblocks >= 0.8 * num_sms:
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    efficiency = []
    for num_splits in range(1, max_splits + 1):
        n_waves = total_mblocks * num_splits / num_sms
        efficiency.append(n_waves / math.ceil(n_waves))
    best = max(efficiency)
    return next(s for s in range(1, max_splits + 1) if efficiency[s - 1] >= 0.85 * best)


def get_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, cache_seqlens, num_splits=0):
    """FA3's AoT scheduler (``prepare_varlen_num_blocks``): each request's dynamic split count, capped by
    ``num_splits`` or, when that is 0, by the heuristic for this batch."""
    total_mblocks = batch_size * cdiv(max_seqlen_q, KBLOCK_M)
    cap = num_splits if num_splits > 0 else num_splits_heuristic(total_mblocks, NUM_SMS,
                                                                 cdiv(max_seqlen_k, KBLOCK_N), MAX_SPLITS)
    num_n_blocks = (cache_seqlens[:batch_size] + KBLOCK_N - 1) // KBLOCK_N
    return num_n_blocks.clamp(min=1, max=cap).to(torch.int32)


def flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q: int, seqused_k, max_seqlen_k: int,
                           block_table, scheduler_metadata, num_splits: int = 0, softmax_scale=1.0):
    """mha_fwd: host code picks the split count and allocates the split accumulators, then the split-KV kernel
    runs one program per (split, query row) and the combine kernel merges the splits by their LSE."""
    batch = cu_seqlens_q.shape[0] - 1
    if num_splits <= 0:                                   # host heuristic: a launch argument of the graph
        num_splits = num_splits_heuristic(batch * cdiv(max_seqlen_q, KBLOCK_M), NUM_SMS,
                                          cdiv(max_seqlen_k, KBLOCK_N), MAX_SPLITS)
    num_tokens = q.shape[0]
    out_accum = torch.empty(num_splits, num_tokens, q.shape[1], device=q.device)
    lse_accum = torch.empty(num_splits, num_tokens, device=q.device)
    t = torch.arange(num_tokens, device=q.device)
    seq = (torch.searchsorted(cu_seqlens_q, t, right=True) - 1).clamp(0, batch - 1)
    q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
    qpos = seqused_k[seq] - q_len + (t - cu_seqlens_q[seq])             # causal position of each query row
    j = torch.arange(MAX_MODEL_LEN, device=q.device)
    keys, values = k_cache[block_table[seq]], v_cache[block_table[seq]]  # [tokens, MAX_MODEL_LEN, DIM]
    scores = (q[:, None, :] * keys).sum(-1) * softmax_scale
    dyn = scheduler_metadata[seq].long().clamp(min=1)                   # this request's dynamic split count
    n_blocks = (seqused_k[seq] + KBLOCK_N - 1) // KBLOCK_N
    blocks_per_split = (n_blocks + dyn - 1) // dyn
    for split in range(num_splits):                                     # the grid's split dimension
        lo = split * blocks_per_split * KBLOCK_N
        hi = torch.minimum((split + 1) * blocks_per_split * KBLOCK_N, seqused_k[seq])
        mine = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None]) & (j[None, :] <= qpos[:, None])
        mine = mine & (split < dyn)[:, None]
        s = scores.masked_fill(~mine, float("-inf"))
        m = s.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[:, None])
        l_sum = p.sum(-1)
        o = (p[..., None] * values).sum(1) / l_sum.clamp(min=1e-30)[:, None]
        out_accum[split].copy_(o)
        lse_accum[split].copy_(torch.where(l_sum > 0, m_safe + torch.log(l_sum.clamp(min=1e-30)),
                                           torch.full_like(l_sum, float("-inf"))))
    lse_max = lse_accum.amax(0)
    lse_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    w = torch.exp(lse_accum - lse_max[None, :])
    return (w[..., None] * out_accum).sum(0) / w.sum(0).clamp(min=1e-30)[:, None]


class FlashAttentionMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.ALWAYS

    def __init__(self, device, variant, use_full_cuda_graph):
        self.device, self.variant = device, variant
        self.aot_schedule = True                          # FA3
        self.use_full_cuda_graph = use_full_cuda_graph
        self.max_cudagraph_size = max(CAPTURE_SIZES)
        self.max_num_splits = _DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH
        if use_full_cuda_graph:
            self.scheduler_metadata = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.int32, device=device)

    def build(self, cm):
        max_num_splits = 0
        if self.variant == "fix" and self.use_full_cuda_graph and cm.num_actual_tokens <= self.max_cudagraph_size:
            # Setting num_splits > 1 may increase the memory usage (the split accumulators), so it is only
            # set for steps that run under a cuda graph.
            max_num_splits = self.max_num_splits
        scheduler_metadata = get_scheduler_metadata(cm.num_reqs, cm.max_query_len, cm.max_seq_len, cm.seq_lens,
                                                    num_splits=max_num_splits)
        if self.use_full_cuda_graph:
            n = scheduler_metadata.shape[0]
            self.scheduler_metadata[:n] = scheduler_metadata
            # Zero the rest, so that padded requests get no work.
            self.scheduler_metadata[n:] = 0
            scheduler_metadata = self.scheduler_metadata[:cm.num_sched_reqs]
        return SimpleNamespace(query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens_view,
                               block_table=cm.block_table, slot_mapping=cm.slot_mapping,
                               max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
                               scheduler_metadata=scheduler_metadata, max_num_splits=max_num_splits)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    key_cache.view(-1, DIM).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, DIM).index_copy_(0, slot_mapping, value)


class Model:
    def __init__(self, device):
        gen = generator(20301)
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos = randn(MAX_MODEL_LEN, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wv, self.wo = (randn(DIM, DIM, gen=gen, device=device, scale=0.6) for _ in range(4))
        self.lm_head = randn(DIM, VOCAB, gen=gen, device=device, scale=0.5)
        self.key_cache = torch.zeros(MAX_NUM_REQS + 1, MAX_MODEL_LEN, DIM, device=device)
        self.value_cache = torch.zeros(MAX_NUM_REQS + 1, MAX_MODEL_LEN, DIM, device=device)
        self.scale = 1.0 / math.sqrt(DIM)

    def forward(self, input_ids, positions):
        """One decoder layer; FlashAttentionImpl.forward reads the step's metadata from the forward context."""
        attn_metadata = get_forward_context().attn_metadata
        h = self.emb[input_ids] + self.pos[positions]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        reshape_and_cache_flash(k, v, self.key_cache, self.value_cache, attn_metadata.slot_mapping)
        o = flash_attn_varlen_func(q, self.key_cache, self.value_cache,
                                   cu_seqlens_q=attn_metadata.query_start_loc,
                                   max_seqlen_q=attn_metadata.max_query_len,
                                   seqused_k=attn_metadata.seq_lens,
                                   max_seqlen_k=attn_metadata.max_seq_len,
                                   block_table=attn_metadata.block_table,
                                   scheduler_metadata=attn_metadata.scheduler_metadata,
                                   num_splits=attn_metadata.max_num_splits,
                                   softmax_scale=self.scale)
        return h + o @ self.wo


class GPUModelRunner:
    def __init__(self, model, device, variant, graphed):
        self.model, self.device, self.graphed = model, device, graphed
        max_tokens = MAX_MODEL_LEN * MAX_NUM_REQS
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(MAX_NUM_REQS + 1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.block_table = torch.full((MAX_NUM_REQS,), PAD_ROW, dtype=torch.long, device=device)
        self.builder = FlashAttentionMetadataBuilder(device, variant, use_full_cuda_graph=graphed)
        self.graphs = {}

    def _prepare_inputs(self, reqs, num_sched_reqs):
        """``reqs``: (KV row, new tokens, tokens already cached). Writes the persistent buffers; the padded
        requests of a graph step are empty (``query_start_loc`` repeats its last offset)."""
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for row, new, cached in reqs:
            ids += new
            pos += range(cached, cached + len(new))
            slots += [row * MAX_MODEL_LEN + p for p in range(cached, cached + len(new))]
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(cached + len(new))
        n, num_reqs = len(ids), len(reqs)
        self.input_ids[:n].copy_(t(ids))
        self.positions[:n].copy_(t(pos))
        self.slot_mapping[:n].copy_(t(slots))
        self.slot_mapping[n:].fill_(PAD_SLOT)
        self.query_start_loc.copy_(t(qsl + [qsl[-1]] * (MAX_NUM_REQS - num_reqs)))
        self.seq_lens.copy_(t(seq_lens + [0] * (MAX_NUM_REQS - num_reqs)))
        self.block_table.copy_(t([row for row, _, _ in reqs] + [PAD_ROW] * (MAX_NUM_REQS - num_reqs)))
        cm = SimpleNamespace(num_reqs=num_reqs, num_sched_reqs=num_sched_reqs, num_actual_tokens=n,
                             max_query_len=max(len(new) for _, new, _ in reqs), max_seq_len=max(seq_lens),
                             query_start_loc=self.query_start_loc[:num_sched_reqs + 1],
                             seq_lens=self.seq_lens, seq_lens_view=self.seq_lens[:num_sched_reqs],
                             block_table=self.block_table[:num_sched_reqs], slot_mapping=self.slot_mapping[:n])
        return n, cm

    def capture_model(self):
        for size in CAPTURE_SIZES:
            # _dummy_run: `size` decode requests of max_model_len tokens (vLLM #19106), writing the padding row
            dummy = [(PAD_ROW, [0], MAX_MODEL_LEN - 1)] * size
            _, cm = self._prepare_inputs(dummy, size)
            cm.slot_mapping = self.slot_mapping[:size]
            _forward_context.attn_metadata = self.builder.build(cm)
            self.graphs[size] = capture(
                lambda size=size: self.model.forward(self.input_ids[:size], self.positions[:size]),
                device=self.device, name=f"FULL decode {size}", owner="GPUModelRunner (FULL cudagraphs)",
                static={"input_ids": self.input_ids, "positions": self.positions,
                        "slot_mapping": self.slot_mapping, "query_start_loc": self.query_start_loc,
                        "seq_lens": self.seq_lens, "block_table": self.block_table,
                        "scheduler_metadata": self.builder.scheduler_metadata},
                state={"key_cache": self.model.key_cache, "value_cache": self.model.value_cache})
            _forward_context.attn_metadata = None

    def execute_model(self, reqs):
        uniform_decode = all(len(new) == 1 for _, new, _ in reqs)
        size = next((s for s in CAPTURE_SIZES if s >= len(reqs)), None)
        if self.graphed and uniform_decode and size is not None:
            n, cm = self._prepare_inputs(reqs, size)          # metadata for the real batch, then padding
            cm.slot_mapping = self.slot_mapping[:size]
            _forward_context.attn_metadata = self.builder.build(cm)
            g, out = self.graphs[size]
            hidden = replay(g, out, real=n, size=size,
                            padded={"input_ids": self.input_ids, "positions": self.positions})
        else:
            n, cm = self._prepare_inputs(reqs, len(reqs))
            _forward_context.attn_metadata = self.builder.build(cm)
            hidden = self.model.forward(self.input_ids[:n], self.positions[:n])
        _forward_context.attn_metadata = None
        last = self.query_start_loc[1:len(reqs) + 1] - 1
        return (hidden[last] @ self.model.lm_head).clone()


def run(variant: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(25490)
    prompt_a = torch.randint(0, VOCAB, (17,), generator=gen).tolist()
    prompt_b = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    decode = torch.randint(0, VOCAB, (12,), generator=gen).tolist()

    def serve(graphed: bool):
        runner = GPUModelRunner(Model(device), device, variant, graphed)
        if graphed:
            runner.capture_model()
        outs = [runner.execute_model([(0, prompt_a, 0), (1, prompt_b, 0)])]      # prefill: eager
        for i in range(4):                                                       # A and B decode, padded to 4
            outs.append(runner.execute_model([(0, [decode[2 * i]], 17 + i), (1, [decode[2 * i + 1]], 11 + i)]))
        for i in range(3):                                                       # B finished: A alone
            outs.append(runner.execute_model([(0, [decode[8 + i]], 21 + i)]))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
