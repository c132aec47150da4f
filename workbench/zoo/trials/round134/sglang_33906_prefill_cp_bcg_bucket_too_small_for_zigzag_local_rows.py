"""SGLang's context-parallel (CP-v2, zigzag) prefill with breakable CUDA graphs (BCG): every global token bucket is
captured as one synthetic request, whose zigzag split gives each CP rank exactly ``bucket / cp_size`` local rows, and
the bucket's CP-local row capacity is frozen at that count (the fixed-address ``input_embeds`` / ``positions`` slices
and the captured segments). At replay ``load_batch`` picks the bucket from the global token count alone
(``_pad_to_bucket``). A multi-request batch of the same size splits unevenly (each request's ``2 * cp_size`` blocks
round up on some ranks, then the per-rank count is aligned), so it can need more CP-local rows than its bucket holds;
``PrefillCPBCGInput.prepare`` then refuses the replay with a RuntimeError and the prefill step crashes. Eager prefill
has no such capacity. The fix searches the captured buckets for the smallest one (within the 2x padding limit) whose
recorded CP-local capacity fits the live layout, in ``can_run_graph`` (admission, else eager) and in ``load_batch``.

Upstream: https://github.com/sgl-project/sglang/pull/33906 ("Fix prefill CP graph overflow with larger bucket search",
sgl-project/sglang, by Baizhou Zhang (Fridge003), opened 2026-08-06, merged 2026-08-07 as commit
5e60363960db96d56b519617d7a75be871f15a0e), read in a stored mirror of SGLang's history (zcnrex/sglang). Read: the full
diff (``python/sglang/srt/layers/cp/bcg.py``: ``PrefillCPBCGInput.required_local_tokens`` / ``select_replay_bucket`` /
``select_replay_bucket_for_batch``; ``runner/prefill_cuda_graph_runner.py``: ``can_run_graph`` and ``load_batch``;
``test/registered/cp/test_cp_strategy_unit.py``: ``TestPrefillCPBCGReplay``) and the PR description (as stored in the
issue index); at the parent 7395ee833: ``layers/cp/bcg.py`` (whole: ``supports_prefill_cp_bcg``,
``filter_prefill_cp_bcg_capture_num_tokens``, ``_slice_output_rows``, ``PrefillCPBCGInput.create`` / ``prepare``,
``execute_prefill_cp_bcg``), ``layers/cp/zigzag.py`` (``ZigzagCPStrategy``: ``can_apply``, ``build_metadata``,
``shard_hidden_states``, ``shard_position_ids``, ``gather_hidden_states``, ``gather_kv_cache``, ``run_attention``,
``materialize_full_kv``, ``_all_gather_reorganized``), ``layers/cp/padding.py`` (whole), ``layers/cp/utils.py``
(``enable_cp_v2``, ``is_cp_v2_active``, ``prepare_cp_forward``, ``cp_split_before_forward``, ``cp_shard_*``,
``cp_gather_after_forward``), ``runner/prefill_cuda_graph_runner.py`` (``can_replay_locally``, ``can_run_graph``,
``capture``, ``_capture_one_stream``, ``capture_one_shape``, ``capture_prepare``, ``load_batch``, ``execute``,
``_run_forward``, ``_prefill_forward_context``, the metadata capture/replay helpers),
``runner/base_cuda_graph_runner.py`` (``_pad_to_bucket``), ``runner_backend/breakable_cuda_graph_backend.py``
(``BreakableCudaGraphBackend``: ``capture_session``, ``capture_one``, output-buffer helpers, ``replay``) and
``runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py`` (``eager_on_graph``, ``_copy_output``,
``BreakableCUDAGraph``, ``BreakableCUDAGraphCapture``).
Not read: the failing CI job's log, the PR's review thread, the GPT-OSS model code, the trtllm_mha backend and its
zigzag page table, ``is_prefill_cp_in_seq_split`` / ``prefill_cp_mode`` of the failing configuration (so the alignment
``2 * cp_size`` is the upstream unit test's choice, not known to be the CI run's), ``ForwardInputBuffers.fill_from``,
the DP, LoRA, chunked-prefix and speculative paths of the runner.
Symptom: from the PR: "The 4-GPU GPT-OSS MXFP4 context-parallel test crashed during prefill BCG replay [...] A live
multi-request zigzag layout can require more CP-local physical rows than the single-request layout captured for the
same global token bucket (for example, 520 live rows versus 512 captured rows)." The crash's text is not quoted there;
the parent's ``prepare`` raises ``RuntimeError: Live batch needs N local CP rows, but global prefill bucket B has
captured capacity C`` for exactly this case (inferred to be what the job hit).
Mechanism: ``capture_prepare`` builds each bucket as one request of ``bucket`` tokens; ``prepare(capture=True)`` shards
it (``build_metadata``: blocks of ``len // (2 cp)``, the remainder to the first blocks; rank r owns blocks r and
``2 cp - 1 - r``; ``pad_logical_token_to_physical`` aligns the per-rank count) and records
``bucket_local_tokens[bucket]``; the segments are captured on ``input_embeds[:captured]`` / ``positions[:captured]``.
At replay ``load_batch`` takes ``_pad_to_bucket(num_tokens)`` and ``prepare(capture=False)`` checks the live physical
per-rank rows against that bucket's capacity. Requests [5, 5, 6] (16 tokens, bucket 16, capacity 8 per rank) give
rank 0 3 + 3 + 3 = 9 logical rows, aligned to 12 > 8: the step raises. ``can_run_graph`` admitted it: it checks only the
global token count and the padding factor.
Doctor: undersized-buffer, at load_batch. The live step's data (12 CP-local rows) does not fit the static CP-local
buffers and graph geometry captured for the bucket the runner chose (8 rows); the bucket is chosen in ``load_batch``
(by global tokens only), the function the fix changes (with ``can_run_graph``'s admission); ``prepare``, which
raises, only detects the misfit.
Fix (upstream): ``PrefillCPBCGInput.required_local_tokens`` computes the aligned maximum per-rank row count of the live
zigzag layout; ``select_replay_bucket`` returns the smallest capture >= the token count, <= 2x it, whose recorded
capacity fits; ``can_run_graph`` returns False (eager) when none fits, and ``load_batch`` replays the selected bucket
(here 32, capacity 16).
Modelled: ``get_cp_padding_align_size``, ``pad_logical_token_to_physical``, ``pad_local_rows``,
``ZigzagContextParallelMetadata``, ``ZigzagCPStrategy`` (``can_apply``, ``build_metadata``, ``shard_hidden_states``,
``shard_position_ids``, ``_all_gather_reorganized``, ``gather_hidden_states``, ``gather_kv_cache``, ``run_attention``),
``is_cp_v2_active``, ``prepare_cp_forward``, ``cp_split_before_forward``, ``cp_gather_after_forward``,
``filter_prefill_cp_bcg_capture_num_tokens``, ``_slice_output_rows``, ``PrefillCPBCGInput`` (``create``, ``prepare``;
the fix's three methods), ``execute_prefill_cp_bcg``, ``ShapeKey``, ``eager_on_graph``, ``BreakableCUDAGraph``,
``BreakableCUDAGraphCapture``, ``BreakableCudaGraphBackend`` (``capture_session``, ``capture_one`` with its shared
output buffer, ``replay``), ``PrefillCudaGraphRunner`` (``_pad_to_bucket``, ``can_replay_locally``, ``can_run_graph``,
``capture``, ``capture_prepare``, ``capture_one_shape``, ``load_batch``, ``execute``, ``_run_forward``,
``_prefill_forward_context``), ``set_tc_piecewise_forward_context``.
Stand-ins: the CP group's ranks are simulated in one process: CP-local tensors carry the rank on dim 1
([rows, cp_size, ...]), the all-gather is that stacked tensor, ``attn_cp_metadata`` is a list of the ranks'
metadata (upstream each rank's process holds its own), ``override_cp_rank`` stands for ``get_parallel().override``;
the model is a tiny dense decoder (learned positional embedding instead of RoPE, unweighted RMSNorm, SiLU MLP, two
layers, width 16) standing in for GPT-OSS; the attention break is one eager function (``unified_attention_with_output``)
that gathers K/V to global order and attends causally per request (upstream: trtllm_mha over combined prev/next KV
lengths after ``materialize_full_kv`` writes the KV cache; no KV cache here: each step is an independent prefill);
break arguments are held strongly (upstream weak-refs them, pinned by the pool); no barriers, DP, LoRA, chunked
prefix or speculative inputs; ``buffer_registry`` reduced to the global ``input_ids`` / ``positions`` slots.
Workload: cp_size 2, buckets [8, 16, 32] captured largest first (CP-local capacities 4, 8, 16), alignment 4. Four
prefill steps: [16], [6, 10], [5, 5, 6], [9, 12] (extend lengths); outputs: each step's last-token logits per request.
Measured: bug: misbehaves (raised RuntimeError: Live batch needs 12 local CP rows, but global prefill bucket 16 has
captured capacity 8) at the third step; the first two replay bucket 16 and equal eager. Fix: equals eager (max |graph
- eager| = 0); steps 3 and 4 replay bucket 32. An extra check run once (not part of the program) put the CP path
within 1.6e-15 of the same model run without CP. Each variant takes about 2 s on the CPU.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
from contextvars import ContextVar
from itertools import accumulate

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/sgl-project/sglang/pull/33906"
FAMILY = "under-sized buffers / shape contracts"
KIND = "undersized-buffer"
SITE = "load_batch"
SYMPTOM = ("Context-parallel prefill with breakable CUDA graphs crashes at replay: a multi-request zigzag batch "
           "needs more CP-local rows (12) than the single-request layout captured for its global token bucket (8)")

CP_SIZE = 2                                   # attn_cp_size == tp_size; every CP rank is simulated in this process
CAPTURE_NUM_TOKENS = [8, 16, 32]              # prefill BCG token buckets
CONTEXT_LEN = 64                              # a capture bucket is one synthetic request of that many tokens
_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR = 2
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, FFN, NUM_LAYERS = 32, 16, 2, 8, 32, 2
DTYPE = torch.float64
SCHEDULE = [[16], [6, 10], [5, 5, 6], [9, 12]]     # extend lengths of the requests of each prefill step

_variant = "bug"
_attn_cp_rank = 0             # get_parallel().attn_cp_rank of the CP rank being computed
_forward_batch = None         # the batch set_tc_piecewise_forward_context publishes to the attention layers
_current_capture_var: ContextVar = ContextVar("current_capture", default=None)


@contextlib.contextmanager
def override_cp_rank(rank: int):
    """``get_parallel().override(attn_cp_rank=rank)``: compute as CP rank ``rank``."""
    global _attn_cp_rank
    prev, _attn_cp_rank = _attn_cp_rank, rank
    try:
        yield
    finally:
        _attn_cp_rank = prev


@contextlib.contextmanager
def set_tc_piecewise_forward_context(forward_batch):
    global _forward_batch
    prev, _forward_batch = _forward_batch, forward_batch
    try:
        yield
    finally:
        _forward_batch = prev


@dataclasses.dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_seq_lens_cpu: list
    seq_lens_cpu: list
    extend_num_tokens: int
    batch_size: int
    input_embeds: torch.Tensor | None = None
    attn_cp_metadata: list | None = None      # one ZigzagContextParallelMetadata per CP rank (upstream: this rank's)


# --- sglang/srt/layers/cp/padding.py, zigzag.py, utils.py (reduced) -------------------------------------------------

def get_cp_padding_align_size() -> int:
    return CP_SIZE * 2        # in-seq-split: attn_cp_size * 2 (the upstream unit test patches 8 for cp 4)


def pad_logical_token_to_physical(metadata) -> None:
    logical_tokens = list(metadata.per_rank_actual_token)
    align_size = get_cp_padding_align_size()
    physical_rank_len = (max(logical_tokens) + align_size - 1) // align_size * align_size
    metadata.per_rank_logical_token = logical_tokens
    metadata.per_rank_actual_token = [physical_rank_len] * len(logical_tokens)
    metadata.max_rank_len = [physical_rank_len] * len(logical_tokens)


def pad_local_rows(x, metadata, dim):
    if metadata.per_rank_logical_token is None or metadata.per_rank_logical_token == metadata.per_rank_actual_token:
        return x
    pad_size = metadata.per_rank_actual_token[0] - x.shape[dim]
    assert pad_size >= 0
    if pad_size == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = pad_size
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


@dataclasses.dataclass
class ZigzagContextParallelMetadata:
    split_list: list
    zigzag_index: list
    cp_reverse_index: list
    reverse_split_len: list
    per_rank_actual_token: list
    max_rank_len: list
    actual_seq_q_prev_list: list
    actual_seq_q_next_list: list
    total_seq_lens: int
    bs: int
    per_rank_logical_token: list | None = None


class ZigzagCPStrategy:
    """Each sequence is cut into ``2 * cp_size`` blocks; rank r owns block r and block ``2 * cp_size - 1 - r``."""

    name = "zigzag"

    def __init__(self, cp_size):
        self.cp_size = cp_size

    @property
    def cp_rank(self):
        return _attn_cp_rank

    def can_apply(self, num_tokens, forward_batch) -> bool:
        if self.cp_size <= 1 or num_tokens < self.cp_size * 2:
            return False
        extend_lens = forward_batch.extend_seq_lens_cpu
        return extend_lens is None or all(int(length) >= self.cp_size * 2 for length in extend_lens)

    def build_metadata(self, num_tokens, seqs_len, extend_seqs_len=None):
        extend_seqs_len = [int(x) for x in (extend_seqs_len or seqs_len or [num_tokens])]
        pad_len = int(num_tokens) - sum(extend_seqs_len)
        if pad_len > 0:
            extend_seqs_len[-1] += pad_len
        bs, cp_segment_num = len(extend_seqs_len), self.cp_size * 2
        per_seq_block_sizes, split_list = [], []
        for length in extend_seqs_len:
            base, rem = length // cp_segment_num, length % cp_segment_num
            block_sizes = [base + 1 if block_id < rem else base for block_id in range(cp_segment_num)]
            per_seq_block_sizes.append(block_sizes)
            split_list.extend(block_sizes)
        per_rank_actual_token = [sum(b[rank] + b[cp_segment_num - 1 - rank] for b in per_seq_block_sizes)
                                 for rank in range(self.cp_size)]
        cp_rank = self.cp_rank
        zigzag_index = (list(range(cp_rank, cp_rank + bs * cp_segment_num, cp_segment_num))
                        + list(range(cp_segment_num - cp_rank - 1, bs * cp_segment_num, cp_segment_num)))
        cp_reverse_index = []
        for batch_id in range(bs):
            cp_reverse_index.extend(list(range(batch_id, cp_segment_num * bs, 2 * bs))
                                    + list(range((cp_segment_num - 1) * bs + batch_id, 0, -2 * bs)))
        reverse_split_len = []
        for rank in range(self.cp_size):
            reverse_split_len += [per_seq_block_sizes[b][rank] for b in range(bs)]
            reverse_split_len += [per_seq_block_sizes[b][cp_segment_num - 1 - rank] for b in range(bs)]
        return ZigzagContextParallelMetadata(
            split_list=split_list, zigzag_index=zigzag_index, cp_reverse_index=cp_reverse_index,
            reverse_split_len=reverse_split_len, per_rank_actual_token=per_rank_actual_token,
            max_rank_len=[max(per_rank_actual_token)] * self.cp_size,
            actual_seq_q_prev_list=[b[cp_rank] for b in per_seq_block_sizes],
            actual_seq_q_next_list=[b[cp_segment_num - cp_rank - 1] for b in per_seq_block_sizes],
            total_seq_lens=sum(extend_seqs_len), bs=bs)

    def shard_hidden_states(self, x, forward_batch):
        metadata = forward_batch.attn_cp_metadata[self.cp_rank]
        chunks = torch.split(x[: metadata.total_seq_lens], metadata.split_list, dim=0)
        return pad_local_rows(torch.cat([chunks[i] for i in metadata.zigzag_index], dim=0), metadata, dim=0)

    def shard_position_ids(self, positions, forward_batch):
        metadata = forward_batch.attn_cp_metadata[self.cp_rank]
        chunks = torch.split(positions[..., : metadata.total_seq_lens], metadata.split_list, dim=-1)
        return pad_local_rows(torch.cat([chunks[i] for i in metadata.zigzag_index], dim=-1), metadata, dim=-1)

    def _all_gather_reorganized(self, x, forward_batch):
        """``x``: [rows, cp_size, ...], every rank's local rows (what the all-gather collects)."""
        meta = forward_batch.attn_cp_metadata[self.cp_rank]
        per_rank_token = meta.per_rank_logical_token or meta.per_rank_actual_token
        return torch.cat([x[:n, rank] for rank, n in enumerate(per_rank_token)], dim=0)

    def gather_hidden_states(self, x, forward_batch):
        meta = forward_batch.attn_cp_metadata[self.cp_rank]
        chunks = torch.split(self._all_gather_reorganized(x, forward_batch), meta.reverse_split_len, dim=0)
        return torch.cat([chunks[i] for i in meta.cp_reverse_index], dim=0)

    gather_kv_cache = gather_hidden_states

    def run_attention(self, q, positions, k_full, v_full, forward_batch):
        """This rank's queries (prev blocks, then next blocks) against the gathered K/V, causal per request."""
        meta = forward_batch.attn_cp_metadata[self.cp_rank]
        logical_tokens = sum(meta.actual_seq_q_prev_list) + sum(meta.actual_seq_q_next_list)
        req = torch.repeat_interleave(torch.arange(meta.bs, device=q.device), torch.tensor(
            meta.actual_seq_q_prev_list, device=q.device))
        req = torch.cat([req, torch.repeat_interleave(torch.arange(meta.bs, device=q.device), torch.tensor(
            meta.actual_seq_q_next_list, device=q.device))])
        starts = torch.tensor([0] + list(accumulate(forward_batch.extend_seq_lens_cpu))[:-1], device=q.device)
        first = starts[req][:, None]
        j = torch.arange(k_full.shape[0], device=q.device)[None, :]
        visible = (j >= first) & (j <= first + positions[:logical_tokens, None])
        scores = torch.einsum("nhd,khd->nhk", q[:logical_tokens], k_full) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        result = torch.einsum("nhk,khd->nhd", torch.softmax(scores, dim=-1), v_full)
        return torch.cat([result, result.new_zeros(q.shape[0] - logical_tokens, *result.shape[1:])], dim=0)


_STRATEGY = ZigzagCPStrategy(cp_size=CP_SIZE)


def get_cp_strategy():
    return _STRATEGY


def is_cp_v2_active(forward_batch) -> bool:
    return get_cp_strategy().can_apply(len(forward_batch.input_ids), forward_batch)     # SGLANG_ENABLE_CP_V2=1


def prepare_cp_forward(forward_batch) -> None:
    assert is_cp_v2_active(forward_batch)
    if forward_batch.attn_cp_metadata is None:
        metas = []
        for rank in range(CP_SIZE):
            with override_cp_rank(rank):
                meta = get_cp_strategy().build_metadata(num_tokens=sum(forward_batch.extend_seq_lens_cpu),
                                                        seqs_len=forward_batch.seq_lens_cpu,
                                                        extend_seqs_len=forward_batch.extend_seq_lens_cpu)
            pad_logical_token_to_physical(meta)
            metas.append(meta)
        forward_batch.attn_cp_metadata = metas


def cp_split_before_forward(complete_hidden_states, complete_position_ids, forward_batch):
    """Every rank's shard, stacked on dim 1: [local rows, cp_size, ...]."""
    locals_, positions = [], []
    for rank in range(CP_SIZE):
        with override_cp_rank(rank):
            locals_.append(get_cp_strategy().shard_hidden_states(complete_hidden_states, forward_batch))
            positions.append(get_cp_strategy().shard_position_ids(complete_position_ids, forward_batch))
    return torch.stack(locals_, dim=1), torch.stack(positions, dim=1)


def cp_gather_after_forward(x, forward_batch):
    return get_cp_strategy().gather_hidden_states(x, forward_batch)


# --- sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph (reduced) ---------------------------------

def _copy_output(dst, src):
    dst.copy_(src)
    return dst


class BreakableCUDAGraph:
    def __init__(self):
        self._segments: list = []
        self._break_fns: list = []

    def replay(self):
        for i, seg in enumerate(self._segments):
            seg.replay()
            if i < len(self._break_fns):
                self._break_fns[i]()


class BreakableCUDAGraphCapture:
    def __init__(self, cuda_graph, pool, device, name):
        self.cuda_graph, self._pool, self.device, self.name = cuda_graph, pool, device, name
        self._ctx = None

    def _begin_new_segment(self):
        g = new_graph(self.device)
        self._ctx = graph(g, pool=self._pool, name=f"{self.name} segment {len(self.cuda_graph._segments)}")
        self._ctx.__enter__()
        self.cuda_graph._segments.append(g)

    def _end_current_segment(self):
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)

    def __enter__(self):
        self._token = _current_capture_var.set(self)
        self._begin_new_segment()
        return self

    def __exit__(self, *exc):
        _current_capture_var.reset(self._token)
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False


def eager_on_graph(enable: bool):
    def decorator(inner):
        if not enable:
            return inner

        def wrapper(*args, **kwargs):
            capture = _current_capture_var.get()
            if capture is None:
                return inner(*args, **kwargs)
            capture._end_current_segment()
            output = inner(*args, **kwargs)
            captured_output = output          # strong ref: the bridge buffer the next segment reads

            def replay_fn():
                return _copy_output(captured_output, inner(*args, **kwargs))

            capture.cuda_graph._break_fns.append(replay_fn)
            capture._begin_new_segment()
            return output
        return wrapper
    return decorator


# --- the model: a tiny dense decoder standing in for GPT-OSS (body CP-local, attention a graph break) -----------------

def _rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@eager_on_graph(True)
def unified_attention_with_output(q, k, v, positions, layer_id):
    """The attention break: gather every rank's K/V (zigzag order -> global order), attend per rank."""
    forward_batch, strategy = _forward_batch, get_cp_strategy()
    k_full, v_full = strategy.gather_kv_cache(k, forward_batch), strategy.gather_kv_cache(v, forward_batch)
    out = torch.zeros_like(q)
    for rank in range(CP_SIZE):
        with override_cp_rank(rank):
            out[:, rank] = strategy.run_attention(q[:, rank], positions[:, rank], k_full, v_full, forward_batch)
    return out


class GptOssModel:
    def __init__(self, gen, device):
        r = lambda *s, scale: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)       # noqa: E731
        self.pos_emb = r(CONTEXT_LEN, HIDDEN, scale=0.5)
        self.layers = [dict(qkv=r(HIDDEN, 3 * HIDDEN, scale=0.3), o=r(HIDDEN, HIDDEN, scale=0.3),
                            up=r(HIDDEN, FFN, scale=0.3), down=r(FFN, HIDDEN, scale=0.3)) for _ in range(NUM_LAYERS)]

    def forward(self, positions, forward_batch, input_embeds):
        h = input_embeds + self.pos_emb[positions]                               # [local rows, cp_size, hidden]
        for i, layer in enumerate(self.layers):
            q, k, v = (_rms_norm(h) @ layer["qkv"]).split(HIDDEN, dim=-1)
            heads = (*q.shape[:-1], NUM_HEADS, HEAD_DIM)
            attn = unified_attention_with_output(q.reshape(heads), k.reshape(heads), v.reshape(heads), positions, i)
            h = h + attn.reshape(h.shape) @ layer["o"]
            h = h + torch.nn.functional.silu(_rms_norm(h) @ layer["up"]) @ layer["down"]
        return _rms_norm(h)


class GptOssForCausalLM:
    def __init__(self, device):
        gen = generator(33906)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).to(DTYPE)
        self.model = GptOssModel(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.3).to(DTYPE)

    def get_input_embeddings(self):
        return lambda input_ids: self.embed_tokens[input_ids]

    def logits_processor(self, input_ids, hidden_states, forward_batch):
        last = torch.tensor(list(accumulate(forward_batch.extend_seq_lens_cpu)), device=hidden_states.device) - 1
        return hidden_states[last] @ self.lm_head

    def forward(self, input_ids, positions, forward_batch):
        """The eager CP-v2 prefill: shard, run the body on the physical local rows, gather, logits."""
        prepare_cp_forward(forward_batch)
        local_embeds, local_positions = cp_split_before_forward(self.get_input_embeddings()(input_ids), positions,
                                                                forward_batch)
        with set_tc_piecewise_forward_context(forward_batch):
            hidden_states = self.model.forward(local_positions, forward_batch, local_embeds)
        return self.logits_processor(input_ids, cp_gather_after_forward(hidden_states, forward_batch), forward_batch)


# --- sglang/srt/layers/cp/bcg.py -------------------------------------------------------------------------------------

def filter_prefill_cp_bcg_capture_num_tokens(capture_num_tokens):
    return [size for size in capture_num_tokens if size >= CP_SIZE * 2]


def _slice_output_rows(output, num_tokens):
    return output[:num_tokens]


@dataclasses.dataclass
class PrefillCPBCGInput:
    """Fixed-address CP-local inputs and per-bucket replay state."""

    input_embeds: torch.Tensor
    positions: torch.Tensor
    bucket_local_tokens: dict = dataclasses.field(default_factory=dict)
    live_local_tokens: int = 0

    @classmethod
    def create(cls, runner):
        return cls(input_embeds=torch.zeros(runner.max_num_tokens, CP_SIZE, HIDDEN, dtype=DTYPE, device=runner.device),
                   positions=torch.zeros(runner.max_num_tokens, CP_SIZE, dtype=torch.int64, device=runner.device))

    # (fix) the three methods below are what the upstream fix adds
    def required_local_tokens(self, extend_seq_lens):
        strategy = get_cp_strategy()
        if extend_seq_lens is None:
            return None
        cp_segment_num = strategy.cp_size * 2
        per_rank_logical_tokens = [0] * strategy.cp_size
        for raw_length in extend_seq_lens:
            base, remainder = divmod(int(raw_length), cp_segment_num)
            for rank in range(strategy.cp_size):
                opposite_rank = cp_segment_num - 1 - rank
                per_rank_logical_tokens[rank] += base * 2 + int(rank < remainder) + int(opposite_rank < remainder)
        align_size = get_cp_padding_align_size()
        return (max(per_rank_logical_tokens) + align_size - 1) // align_size * align_size

    def select_replay_bucket(self, *, num_tokens, required_local_tokens, capture_num_tokens, max_padding_factor):
        """Return the smallest global capture whose CP-local rows fit."""
        for bucket in capture_num_tokens:
            if bucket < num_tokens:
                continue
            if bucket > num_tokens * max_padding_factor:
                break
            captured_local_tokens = self.bucket_local_tokens.get(bucket)
            if captured_local_tokens is not None and required_local_tokens <= captured_local_tokens:
                return bucket
        return None

    def select_replay_bucket_for_batch(self, *, num_tokens, extend_seq_lens, capture_num_tokens, max_padding_factor):
        required_local_tokens = self.required_local_tokens(extend_seq_lens)
        if required_local_tokens is None:
            return None
        return self.select_replay_bucket(num_tokens=num_tokens, required_local_tokens=required_local_tokens,
                                         capture_num_tokens=capture_num_tokens, max_padding_factor=max_padding_factor)

    def prepare(self, runner, forward_batch, *, static_num_tokens, capture):
        """Shard global prefill inputs into fixed-address CP-local buffers."""
        forward_batch.attn_cp_metadata = None
        prepare_cp_forward(forward_batch)
        captured_local_tokens = None
        if not capture:
            try:
                captured_local_tokens = self.bucket_local_tokens[static_num_tokens]
            except KeyError as exc:
                raise RuntimeError(f"Missing CP-local capture capacity for global prefill bucket "
                                   f"{static_num_tokens}") from exc
            for metadata in forward_batch.attn_cp_metadata:     # upstream: the one metadata of this rank's process
                live_physical_tokens = max(metadata.per_rank_actual_token)
                if live_physical_tokens > captured_local_tokens:
                    raise RuntimeError(f"Live batch needs {live_physical_tokens} local CP rows, but global prefill "
                                       f"bucket {static_num_tokens} has captured capacity {captured_local_tokens}")
                metadata.per_rank_actual_token = [captured_local_tokens] * CP_SIZE
                metadata.max_rank_len = [captured_local_tokens] * CP_SIZE
        raw_tokens = int(forward_batch.extend_num_tokens)
        global_input_embeds = runner.model_runner.model.get_input_embeddings()(forward_batch.input_ids[:raw_tokens])
        local_input_embeds, local_positions = cp_split_before_forward(
            global_input_embeds, forward_batch.positions[:raw_tokens], forward_batch)
        live_local_tokens = int(local_input_embeds.shape[0])
        if capture:
            captured_local_tokens = live_local_tokens
            self.bucket_local_tokens[static_num_tokens] = captured_local_tokens
        elif live_local_tokens > captured_local_tokens:
            raise RuntimeError(f"Live batch needs {live_local_tokens} local CP rows, but global prefill bucket "
                               f"{static_num_tokens} has captured capacity {captured_local_tokens}")
        if captured_local_tokens > self.input_embeds.shape[0]:
            raise RuntimeError(f"CP-local capture needs {captured_local_tokens} rows, but the fixed input buffer "
                               f"has capacity {self.input_embeds.shape[0]}")
        input_embeds = self.input_embeds[:captured_local_tokens]
        positions = self.positions[:captured_local_tokens]
        input_embeds.zero_()
        positions.zero_()
        input_embeds[:live_local_tokens].copy_(local_input_embeds)
        positions[:live_local_tokens].copy_(local_positions)
        forward_batch.input_embeds, forward_batch.positions = input_embeds, positions
        self.live_local_tokens = live_local_tokens


def execute_prefill_cp_bcg(runner, forward_batch, static_forward_batch, static_num_tokens, raw_num_tokens):
    """Replay a CP-local body and run the global gather/logits tail eagerly."""
    cp_input, model = runner.prefill_cp_bcg_input, runner.model_runner.model
    with runner._prefill_forward_context(static_forward_batch):
        local_output = runner.backend.replay(ShapeKey(size=static_num_tokens), static_forward_batch,
                                             eager=lambda: runner._run_forward(static_forward_batch, static_num_tokens))
        local_output = _slice_output_rows(local_output, cp_input.live_local_tokens)
        hidden_states = cp_gather_after_forward(local_output, static_forward_batch)
        return model.logits_processor(forward_batch.input_ids, hidden_states, forward_batch)


# --- sglang/srt/model_executor/runner_backend/breakable_cuda_graph_backend.py (reduced) ------------------------------

@dataclasses.dataclass(frozen=True)
class ShapeKey:
    size: int
    variant_label: str | None = None


class BreakableCudaGraphBackend:
    def __init__(self, cuda_graph_runner):
        self.device = cuda_graph_runner.device
        self._graphs, self._outputs = {}, {}
        self._pool = None
        self._shared_output_buffer = None

    def capture_session(self):
        if self._pool is None:
            self._pool = graph_pool_handle(self.device)

    def capture_one(self, shape_key, forward_fn):
        warmup_out = None
        for _ in range(2):
            with events.warmup():
                warmup_out = forward_fn()
        cuda_graph = BreakableCUDAGraph()
        size = shape_key.size
        if self._shared_output_buffer is None:
            self._shared_output_buffer = warmup_out.new_empty((size, *warmup_out.shape[1:]))
            events.shared_outputs("BreakableCudaGraphBackend", {"shared_output_buffer": self._shared_output_buffer})
        with BreakableCUDAGraphCapture(cuda_graph, self._pool, self.device, f"prefill bucket {size}"):
            out = forward_fn()
            out_rows = min(size, out.shape[0])
            self._shared_output_buffer[:out_rows].copy_(out[:out_rows])
        self._graphs[shape_key] = cuda_graph
        self._outputs[shape_key] = self._shared_output_buffer[:out_rows]

    def replay(self, shape_key, static_forward_batch, *, eager):
        cuda_graph, output = self._graphs[shape_key], self._outputs[shape_key]
        segments = tuple(cuda_graph._segments)
        events.serve(segments[0], output.shape[0], output.shape[0], outputs=output, pieces=segments, eager=eager)
        cuda_graph.replay()
        view = output.view_as(output)
        events.handed_out(segments[-1], view)
        return view


# --- sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py (reduced) ----------------------------------------

class PrefillCudaGraphRunner:
    def __init__(self, model_runner):
        self.model_runner, self.device = model_runner, model_runner.device
        self.capture_num_tokens = filter_prefill_cp_bcg_capture_num_tokens(list(CAPTURE_NUM_TOKENS))
        self.max_num_tokens = self.capture_num_tokens[-1]
        self.enable_cp_v2_bcg_capture = True
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)   # registry slots
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        self.prefill_cp_bcg_input = PrefillCPBCGInput.create(self)
        self.backend = BreakableCudaGraphBackend(self)
        events.static_buffers("PrefillCudaGraphRunner", {"cp_input_embeds": self.prefill_cp_bcg_input.input_embeds,
                                                         "cp_positions": self.prefill_cp_bcg_input.positions})

    @staticmethod
    def _pad_to_bucket(raw_size, buckets):
        assert raw_size <= buckets[-1], f"size {raw_size} exceeds max captured bucket {buckets[-1]}"
        return buckets[bisect.bisect_left(buckets, raw_size)]

    def _prefill_forward_context(self, forward_batch):
        return set_tc_piecewise_forward_context(forward_batch)

    def _run_forward(self, forward_batch, num_tokens):
        with self._prefill_forward_context(forward_batch):
            return self.model_runner.model.model.forward(forward_batch.positions, forward_batch,
                                                         forward_batch.input_embeds)

    def can_replay_locally(self, *, num_tokens):
        if num_tokens > self.max_num_tokens:
            return False
        padded_num_tokens = self._pad_to_bucket(num_tokens, self.capture_num_tokens)
        return padded_num_tokens <= num_tokens * _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR

    def can_run_graph(self, forward_batch) -> bool:
        if not self.can_replay_locally(num_tokens=len(forward_batch.input_ids)):
            return False
        if _variant == "fix" and self.enable_cp_v2_bcg_capture and is_cp_v2_active(forward_batch):
            if self.prefill_cp_bcg_input.select_replay_bucket_for_batch(
                    num_tokens=len(forward_batch.input_ids), extend_seq_lens=forward_batch.extend_seq_lens_cpu,
                    capture_num_tokens=self.capture_num_tokens,
                    max_padding_factor=_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR) is None:
                return False
        return True

    def capture(self):
        self.backend.capture_session()
        for num_tokens in reversed(self.capture_num_tokens):
            self.capture_one_shape(num_tokens)

    def capture_prepare(self, num_tokens):
        capture_seq_lens = [min(CONTEXT_LEN, num_tokens - start) for start in range(0, num_tokens, CONTEXT_LEN)]
        return ForwardBatch(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                            extend_seq_lens_cpu=list(capture_seq_lens), seq_lens_cpu=list(capture_seq_lens),
                            extend_num_tokens=num_tokens, batch_size=len(capture_seq_lens))

    def capture_one_shape(self, size):
        forward_batch = self.capture_prepare(size)
        self.prefill_cp_bcg_input.prepare(self, forward_batch, static_num_tokens=size, capture=True)
        self.backend.capture_one(ShapeKey(size=size), lambda: self._run_forward(forward_batch, size))

    def load_batch(self, forward_batch):
        """Pad, populate static buffers, and build the static_forward_batch the replay reads."""
        num_tokens = len(forward_batch.input_ids)
        static_num_tokens = self._pad_to_bucket(num_tokens, self.capture_num_tokens)
        if _variant == "fix" and self.enable_cp_v2_bcg_capture and is_cp_v2_active(forward_batch):
            static_num_tokens = self.prefill_cp_bcg_input.select_replay_bucket_for_batch(
                num_tokens=num_tokens, extend_seq_lens=forward_batch.extend_seq_lens_cpu,
                capture_num_tokens=self.capture_num_tokens, max_padding_factor=_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR)
            if static_num_tokens is None:
                raise RuntimeError("Prefill CUDA graph replay was admitted without a fitting bucket")
        self.raw_num_tokens = num_tokens
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)          # buffer_registry.fill_from (reduced)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        static_forward_batch = ForwardBatch(
            input_ids=self.input_ids[:static_num_tokens], positions=self.positions[:static_num_tokens],
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu, seq_lens_cpu=forward_batch.seq_lens_cpu,
            extend_num_tokens=forward_batch.extend_num_tokens, batch_size=forward_batch.batch_size)
        self.prefill_cp_bcg_input.prepare(self, static_forward_batch, static_num_tokens=static_num_tokens,
                                          capture=False)
        return static_forward_batch

    def execute(self, forward_batch):
        static_forward_batch = self.load_batch(forward_batch)
        return execute_prefill_cp_bcg(self, forward_batch, static_forward_batch, len(static_forward_batch.input_ids),
                                      self.raw_num_tokens)


class ModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = GptOssForCausalLM(device)
        self.prefill_graph_runner = None
        if use_cuda_graph:
            self.prefill_graph_runner = PrefillCudaGraphRunner(self)
            self.prefill_graph_runner.capture()

    def forward_extend(self, forward_batch):
        if self.prefill_graph_runner is not None and self.prefill_graph_runner.can_run_graph(forward_batch):
            return self.prefill_graph_runner.execute(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(7)
    batches = []
    for lens in SCHEDULE:
        ids = torch.randint(0, VOCAB, (sum(lens),), generator=gen).to(device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        batches.append((ids, positions, lens))

    def make(ids, positions, lens):
        return ForwardBatch(input_ids=ids, positions=positions, extend_seq_lens_cpu=list(lens),
                            seq_lens_cpu=list(lens), extend_num_tokens=sum(lens), batch_size=len(lens))

    def serve_all(use_cuda_graph):
        with torch.no_grad():
            model_runner = ModelRunner(device, use_cuda_graph)
            return [model_runner.forward_extend(make(*b)).clone() for b in batches]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve_all(True), lambda: serve_all(False))
