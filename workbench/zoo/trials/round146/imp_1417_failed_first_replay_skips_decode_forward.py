"""imp (kekzl/imp, a C++/CUDA LLM inference engine) decodes each batch size through its own ``CudaGraphRunner``:
the runner's first ``execute`` runs the step eagerly (warmup), the next one captures the decode forward and replays
the graph at once -- "a capture records launches *without executing them*, so the replay IS that step's execution" --
and later steps replay. When that first replay failed, ``execute`` did ``graph_.reset(); return false;``: every
other failure path in the function re-runs ``decode_fn_``, this one did not, and it left ``capture_failed_`` unset.
The batched decode call site ignores the return value and samples from the executor's logits buffer
(``logits_out``, or ``get_logits_view()``), which the step never wrote: it still holds the previous step's logits, so
greedy decoding repeats the previous token, and the step's K/V are never written to the cache. The runner then
re-captures on the next step (for a structural failure, skipping a forward every step). The fix runs the step
eagerly after a failed first replay and marks the runner eager for good (``capture_failed_ = true``).

Upstream: https://github.com/kekzl/imp/pull/1417 ("fix(graph): run the forward when the first replay fails, and log
why prefill capture is skipped", repository kekzl/imp, author kekzl, described 2026-08-14, merged; merge date and
commit not known to me). Read: the PR description (the section "A failed first replay skipped the step's forward
pass"; its "Test" section was cut off where I read it); ``CudaGraphRunner::execute`` before the fix, in a mirror of the
repository at d508b5e (2026-03-16; the PR is five months later, but its description quotes the same failing branch,
``graph_.reset(); return false;``), with ``CudaGraphCapture`` and the decode call site of that time
(``src/runtime/engine.cpp``: ``set_decode_fn([..., &logits_out] { executor_->forward_logits(state, logits_out, s);
})``, ``execute``, then ``if (logits_out.data == nullptr) logits_out = executor_->get_logits_view(n)`` and eager
sampling), ``GraphExecutor::forward_logits`` (``logits_out = lg``, a view of the internal ``logits_`` buffer) and
``get_logits_view``; after the fix, stored versions at commit 01c5128 of ``src/runtime/cuda_graph.cu`` (the whole
``CudaGraphCapture`` and ``CudaGraphRunner::execute``, with the fix and its comment) and ``src/runtime/cuda_graph.h``
(``warmup_steps_ = 1``, ``set_fail_next_replay_for_test``), a stored ``src/runtime/engine_scheduler.cpp``
(``Engine::step``, ``step_decode_forward`` with ``decode_graph_pool_[n_sequences - 1]`` and the same call site,
``decode_build_inference_state_``; commit 000c42c), and the test ``CaptureAbort.FirstReplayFailureStillExecutesTheStep``
in ``tests/test_capture_abort.cu`` (by its comment and its use of the hook, added with the fix).
Not read: the PR's literal diff (the mirror predates it; I compared the code before and after instead), its review
thread (if any), the other call sites of ``execute`` (the PR says four of five ignore its return value), the prefill
graph and the PR's logging change, ``invalidate_for_update``/``end_capture_and_update`` beyond their signatures, the
kernels, and what made the first replay fail in the investigation behind the PR (the header says such a launch
failure "cannot be provoked from outside without relying on undefined behaviour").
Symptom: the PR: "Under greedy that repeats a token for as long as the failure lasts, while the only symptom is one
ERROR line" (``CudaGraphRunner: first replay after capture failed``); no user report.
Mechanism: on the capture step ``decode_fn_`` runs only inside the capture, which records the forward (the KV write,
attention, the lm head writing ``logits_``) without executing it. The injected failure stops the launch; the runner
resets the graph and returns. ``step_decode_forward`` samples from ``logits_out`` -- here the capture pass had set it
to the view of ``logits_`` (as imp's ``forward_logits`` does; the PR says the call site found it null and fell back to
``get_logits_view``, the same memory) -- which holds the previous step's logits. Request B gets its previous token
again, the K/V of its position 8 stay unwritten, and the next step (which re-captures, the injection spent, and replays)
attends over that empty slot with a wrong context, so B's later tokens and logits differ too. Without graphs every
step runs its forward.
Doctor: stale-input, at ``execute``: the step's sampler reads the logits buffer the graph writes, and on this step no
replay and no eager run wrote it, so its values are what the previous step left there. ``execute`` decides it: its
failed-first-replay branch returns without running ``decode_fn_``; it is the function the fix changes. (Not
warmup-divergence: the captured forward is the eager one; what differs is that nothing ran it on this step.)
Fix (upstream): after a failed first replay ``execute`` resets the graph, sets ``capture_failed_ = true``, runs
``decode_fn_(stream)`` and returns true (the capture pass plus the eager re-run: two calls, as the test checks);
later steps take the ``capture_failed_`` branch and run eagerly (``capture_count() == 1``). The same PR added the
test hook ``set_fail_next_replay_for_test()`` and a log line for skipped prefill capture (not modelled).
Modelled: ``CudaGraphCapture`` (``capture`` for begin/end capture, ``replay``, ``reset``, ``is_captured``),
``CudaGraphRunner`` (``set_decode_fn``, ``execute``, ``set_fail_next_replay_for_test``, ``step_count_``,
``warmup_steps_``, ``capture_failed_``, ``capture_count_``, ``replay_count_``), ``GraphExecutor`` (``forward_logits``,
``get_logits_view``, ``logits_``), ``InferenceState``, ``Batch``/``BatchBuilder`` (``add_decode_sequence``,
``build``), ``GPUBatch``, ``GPUBatchPool.upload_into_pool``, ``KVCacheManager``, ``Engine`` (``step``,
``step_prefill``, ``step_decode``, ``step_decode_forward`` with ``sample_per_request``,
``decode_build_inference_state_``, ``decode_graph_pool_``).
Stand-ins: the launch failure is the upstream test hook, set once on the batch-size-1 runner (in both variants; before
the fix the hook did not exist, and the failing ``cudaGraphLaunch`` it stands for had the same effect). Streams,
cudaGraphExecUpdate, PDL edges, ``mark_process_warm``, ``invalidate_for_update`` (the pool pads every block table to
the same width, so it never trips), the async/conditional graph loop, penalties, logprobs and constraints are left
out. The model is mine: 2 layers of width 16 (RMSNorm, one attention head over paged K/V, SiLU MLP of 32), vocabulary
24, a learned absolute position embedding instead of RoPE, float64, greedy sampling; block size 4. Prefill runs
eagerly one token at a time through ``forward_logits`` (imp prefills in one pass). The run without graphs is the same
engine with ``use_cuda_graphs`` off (the ``else`` branch: ``forward_logits`` and sampling every step).
Workload: request A (prompt of 5, 4 new tokens) and B (prompt of 4, 8 new tokens), prefilled eagerly (each prefill
gives the first new token); three decode steps of both (the size-2 runner: warmup, capture and first replay, replay),
then four of B alone (the size-1 runner: warmup, then the capture whose first replay fails, then two more steps).
Outputs: the logits each step sampled from, the tokens, and the K/V cache at the end.
Measured: the check printed
  imp_1417_failed_first_replay_skips_decode_forward [bug] on cpu: misbehaves (max |graph - eager| = 22.2)
  imp_1417_failed_first_replay_skips_decode_forward [fix] on cpu: equals eager (max |graph - eager| = 0)
Without graphs B's tokens are 15 (prefill), 5, 7, 22 (with A), 5, 13, 9, 11 (alone). With the bug the failed step
samples 5 again (step 4's logits, unchanged) instead of 13, the next two give 0 and 8 instead of 9 and 11 (logits
off by up to 22.2), and B's K/V slot for position 8 holds zeros; the size-2 graph's steps agree. With the fix the
size-1 runner captured once, replayed never and ran eagerly from then on. The whole check took about 4 s on the CPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/kekzl/imp/pull/1417"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "execute"
SYMPTOM = ("when the first replay after a decode-graph capture failed, CudaGraphRunner::execute returned without "
           "running the step's forward, so the sampler read the previous step's logits (greedy repeated the token) "
           "and the step's K/V were never written")

VOCAB, DIM, FFN, LAYERS = 24, 16, 32, 2
BLOCK, NUM_BLOCKS, MAX_BLOCKS_PER_SEQ, MAX_BATCH, MAX_TOKENS = 4, 8, 4, 2, 8
DTYPE = torch.float64
_variant = "bug"


# --- model ----------------------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Layer:
    def __init__(self, gen, device):
        def w(*shape, scale):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.attn_norm, self.ffn_norm = w(DIM, scale=0.1) + 1.0, w(DIM, scale=0.1) + 1.0
        self.wq, self.wk, self.wv, self.wo = (w(DIM, DIM, scale=DIM ** -0.5) for _ in range(4))
        self.w1, self.w2 = w(DIM, FFN, scale=DIM ** -0.5), w(FFN, DIM, scale=FFN ** -0.5)


class Model:
    def __init__(self, device):
        gen = generator(1417)
        self.tok_embeddings = (torch.randn(VOCAB, DIM, generator=gen, dtype=DTYPE)).to(device)
        self.pos_embeddings = (torch.randn(MAX_BLOCKS_PER_SEQ * BLOCK, DIM, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [Layer(gen, device) for _ in range(LAYERS)]
        self.norm = torch.ones(DIM, dtype=DTYPE, device=device)
        self.lm_head = (torch.randn(DIM, VOCAB, generator=gen, dtype=DTYPE) * 1.5).to(device)


@dataclasses.dataclass
class InferenceState:
    token_ids: Tensor
    positions: Tensor
    n_tokens: int
    n_sequences: int
    max_blocks_per_seq: int
    block_tables: Tensor          # [n_sequences, max_blocks_per_seq]
    context_lens: Tensor          # [n_sequences]
    max_context_len: int


class TensorHandle:
    """(stand-in) imp's ``Tensor`` as the call site uses it: ``data`` is null until ``forward_logits`` sets it."""

    def __init__(self):
        self.data: Tensor | None = None


class GraphExecutor:
    def __init__(self, model: Model, kv_cache: Tensor, device):
        self.model_, self.kv_cache_ = model, kv_cache
        self.logits_ = torch.zeros(MAX_TOKENS, VOCAB, dtype=DTYPE, device=device)   # [max_logit_tokens, vocab]
        self.ctx_pos_ = torch.arange(MAX_BLOCKS_PER_SEQ * BLOCK, device=device)

    def forward_logits(self, state: InferenceState, logits_out: TensorHandle) -> Tensor:
        """One token per sequence: write its K/V into its paged slot, attend over its context, write ``logits_``;
        ``logits_out`` becomes a view of the internal logits buffer."""
        m, n = self.model_, state.n_tokens
        slot = (state.block_tables.gather(1, (state.positions // BLOCK)[:, None])[:, 0] * BLOCK
                + state.positions % BLOCK)
        pos = self.ctx_pos_
        ctx_slots = state.block_tables[:, pos // BLOCK] * BLOCK + pos % BLOCK            # [n, ctx]
        h = m.tok_embeddings[state.token_ids] + m.pos_embeddings[state.positions]
        for i, layer in enumerate(m.layers):
            x = rms_norm(h, layer.attn_norm)
            q, k, v = x @ layer.wq, x @ layer.wk, x @ layer.wv
            self.kv_cache_[i, 0].index_copy_(0, slot, k)
            self.kv_cache_[i, 1].index_copy_(0, slot, v)
            keys, values = self.kv_cache_[i, 0][ctx_slots], self.kv_cache_[i, 1][ctx_slots]
            scores = (keys @ q[:, :, None]).squeeze(-1) / math.sqrt(DIM)
            scores = scores.masked_fill(pos[None, :] >= state.context_lens[:, None], float("-inf"))
            h = h + (torch.softmax(scores, -1)[:, :, None] * values).sum(1) @ layer.wo
            x = rms_norm(h, layer.ffn_norm)
            g = x @ layer.w1
            h = h + (g * torch.sigmoid(g)) @ layer.w2
        lg = self.logits_[:n]
        lg.copy_(rms_norm(h, m.norm) @ m.lm_head)
        logits_out.data = lg
        return lg

    def get_logits_view(self, n: int) -> Tensor:
        return self.logits_[:n]


# --- batches --------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Batch:
    token_ids: list
    positions: list
    block_tables: list
    context_lens: list
    n_sequences: int
    max_blocks_per_seq: int


class BatchBuilder:
    def __init__(self):
        self.seqs: list = []

    def reset(self) -> None:
        self.seqs = []

    def add_decode_sequence(self, token: int, position: int, block_table: list, n_blocks: int, ctx_len: int) -> None:
        self.seqs.append((token, position, list(block_table[:n_blocks]), ctx_len))

    def build(self) -> Batch:
        width = max(len(bt) for _, _, bt, _ in self.seqs)
        tables = [b for _, _, bt, _ in self.seqs for b in bt + [0] * (width - len(bt))]
        return Batch([s[0] for s in self.seqs], [s[1] for s in self.seqs], tables, [s[3] for s in self.seqs],
                     len(self.seqs), width)


@dataclasses.dataclass
class GPUBatch:
    d_token_ids: Tensor
    d_positions: Tensor
    d_block_tables: Tensor
    d_context_lens: Tensor
    n_sequences: int
    max_blocks_per_seq: int
    total_tokens: int


def _long(xs: list, device) -> Tensor:
    return torch.tensor(xs, dtype=torch.long).to(device)


class GPUBatchPool:
    """Pre-allocated device memory for stable CUDA Graph pointers."""

    def __init__(self, device):
        self.device = device

    def allocate(self, max_batch_size: int, max_blocks_per_seq: int) -> None:
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=self.device)
        self.max_blocks_per_seq_ = max_blocks_per_seq
        self.d_token_ids_, self.d_positions_ = z(max_batch_size), z(max_batch_size)
        self.d_block_tables_, self.d_context_lens_ = z(max_batch_size, max_blocks_per_seq), z(max_batch_size)

    def max_blocks_per_seq(self) -> int:
        return self.max_blocks_per_seq_

    def upload_into_pool(self, batch: Batch) -> GPUBatch:
        n, w = batch.n_sequences, batch.max_blocks_per_seq
        self.d_token_ids_[:n].copy_(_long(batch.token_ids, self.device))
        self.d_positions_[:n].copy_(_long(batch.positions, self.device))
        self.d_block_tables_[:n].copy_(_long(batch.block_tables, self.device).view(n, w))
        self.d_context_lens_[:n].copy_(_long(batch.context_lens, self.device))
        return GPUBatch(self.d_token_ids_[:n], self.d_positions_[:n], self.d_block_tables_[:n],
                        self.d_context_lens_[:n], n, w, n)


# --- graphs ---------------------------------------------------------------------------------------------------------

class CudaGraphCapture:
    def __init__(self, device, name: str):
        self.device, self.name = device, name
        self.graph_, self.outputs_, self.captured_ = None, None, False

    def capture(self, decode_fn) -> bool:
        """begin_capture, ``decode_fn_(stream)`` recorded (not executed), end_capture_and_update."""
        self.graph_, self.outputs_ = capture(decode_fn, device=self.device, warmups=0, name=self.name,
                                             owner="imp CudaGraphRunner (decode)")
        self.captured_ = True
        return True

    def replay(self) -> bool:
        replay(self.graph_, self.outputs_)
        return True

    def is_captured(self) -> bool:
        return self.captured_

    def reset(self) -> None:
        if self.graph_ is not None:
            self.graph_.reset()
        self.graph_, self.outputs_, self.captured_ = None, None, False


class CudaGraphRunner:
    """First ``execute``: runs the decode function eagerly (warmup); second: captures it and replays at once;
    then replays."""

    def __init__(self, device, name: str):
        self.decode_fn_ = None
        self.graph_ = CudaGraphCapture(device, name)
        self.step_count_, self.warmup_steps_ = 0, 1
        self.replay_count_, self.capture_count_ = 0, 0
        self.capture_failed_ = False
        self.fail_next_replay_for_test_ = False

    def set_decode_fn(self, fn) -> None:
        self.decode_fn_ = fn

    def set_fail_next_replay_for_test(self) -> None:
        self.fail_next_replay_for_test_ = True

    def execute(self) -> bool:
        if self.decode_fn_ is None:
            return False
        # Phase 1: Warmup - run without graph capture (a real step: its results are sampled)
        if self.step_count_ < self.warmup_steps_:
            with events.warmup(real=True):
                self.decode_fn_()
            self.step_count_ += 1
            return True
        # Phase 2: Capture - capture the graph on the first post-warmup step
        if not self.graph_.is_captured():
            if self.capture_failed_:
                self.decode_fn_()
                self.step_count_ += 1
                return True
            self.graph_.capture(self.decode_fn_)
            self.capture_count_ += 1
            self.step_count_ += 1
            # During graph capture the kernels are recorded but NOT executed: replay immediately so this step
            # produces actual results.
            inject_fail = self.fail_next_replay_for_test_
            self.fail_next_replay_for_test_ = False
            replay_ok = not inject_fail and self.graph_.replay()
            if not replay_ok:
                # "CudaGraphRunner: first replay after capture failed"
                self.graph_.reset()
                if _variant == "bug":
                    return False
                self.capture_failed_ = True          # a first-replay failure is structural: stay eager
                self.decode_fn_()                    # the capture executed nothing: run the step for real
                return True
            self.replay_count_ += 1
            return True
        # Phase 3: Replay the captured graph
        if not self.graph_.replay():
            self.graph_.reset()
            self.step_count_ = 0
            self.decode_fn_()
            return True
        self.replay_count_ += 1
        self.step_count_ += 1
        return True


# --- engine ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Request:
    id: str
    input_tokens: list
    max_tokens: int
    output_tokens: list = dataclasses.field(default_factory=list)

    def context_len(self) -> int:
        return len(self.input_tokens) + len(self.output_tokens)

    def finished(self) -> bool:
        return len(self.output_tokens) >= self.max_tokens


class KVCacheManager:
    def __init__(self):
        self.free, self.tables = list(range(NUM_BLOCKS)), {}

    def ensure(self, req_id: str, ctx_len: int) -> list:
        table = self.tables.setdefault(req_id, [])
        while len(table) * BLOCK < ctx_len:
            table.append(self.free.pop(0))
        return table

    def block_table(self, req_id: str) -> list:
        return self.tables[req_id]

    def free_sequence(self, req_id: str) -> None:
        self.free.extend(self.tables.pop(req_id))


class Engine:
    def __init__(self, model: Model, device, use_cuda_graphs: bool):
        self.device, self.use_cuda_graphs = device, use_cuda_graphs
        self.kv_cache_raw_ = torch.zeros(LAYERS, 2, NUM_BLOCKS * BLOCK, DIM, dtype=DTYPE, device=device)
        self.executor_ = GraphExecutor(model, self.kv_cache_raw_, device)
        self.kv_manager_ = KVCacheManager()
        self.decode_builder_ = BatchBuilder()
        self.decode_batch_pool_ = GPUBatchPool(device)
        self.decode_batch_pool_.allocate(MAX_BATCH, MAX_BLOCKS_PER_SEQ)
        self.decode_graph_pool_ = [CudaGraphRunner(device, f"decode bs {i + 1}") for i in range(MAX_BATCH)]
        self.running: list = []
        self.outputs: list = []
        if use_cuda_graphs:
            p = self.decode_batch_pool_
            events.static_buffers("imp Engine (decode_batch_pool_)", {
                "d_token_ids_": p.d_token_ids_, "d_positions_": p.d_positions_,
                "d_block_tables_": p.d_block_tables_, "d_context_lens_": p.d_context_lens_})
            events.persistent_state("imp Engine", {"kv_cache": self.kv_cache_raw_})

    def add_request(self, req: Request) -> None:
        self.running.append(req)

    # -- prefill (eager in both runs) --
    def step_prefill(self, req: Request) -> None:
        table = self.kv_manager_.ensure(req.id, len(req.input_tokens))
        bt = _long(table + [0] * (MAX_BLOCKS_PER_SEQ - len(table)), self.device)[None]
        logits_out = TensorHandle()
        for pos, tok in enumerate(req.input_tokens):
            state = InferenceState(_long([tok], self.device), _long([pos], self.device), 1, 1, MAX_BLOCKS_PER_SEQ,
                                   bt, _long([pos + 1], self.device), pos + 1)
            self.executor_.forward_logits(state, logits_out)
        self.outputs.append(logits_out.data.clone())
        req.output_tokens.append(int(logits_out.data[0].argmax()))

    # -- decode --
    def decode_build_inference_state_(self, gpu_batch: GPUBatch, max_ctx: int) -> InferenceState:
        return InferenceState(gpu_batch.d_token_ids, gpu_batch.d_positions, gpu_batch.total_tokens,
                              gpu_batch.n_sequences, gpu_batch.max_blocks_per_seq, gpu_batch.d_block_tables,
                              gpu_batch.d_context_lens, max_ctx)

    def step_decode_forward(self, valid_decode: list) -> list:
        self.decode_builder_.reset()
        max_ctx = 0
        for req in valid_decode:
            ctx_len = req.context_len()
            max_ctx = max(max_ctx, ctx_len)
            bt = self.kv_manager_.ensure(req.id, ctx_len)
            self.decode_builder_.add_decode_sequence(req.output_tokens[-1], ctx_len - 1, bt, len(bt), ctx_len)
        batch = self.decode_builder_.build()
        pool_max = self.decode_batch_pool_.max_blocks_per_seq()
        if batch.max_blocks_per_seq < pool_max:             # pad the block-table stride to the pool's
            n, w = batch.n_sequences, batch.max_blocks_per_seq
            rows = [batch.block_tables[s * w:(s + 1) * w] + [0] * (pool_max - w) for s in range(n)]
            batch.block_tables = [b for row in rows for b in row]
            batch.max_blocks_per_seq = pool_max
        gpu_batch = self.decode_batch_pool_.upload_into_pool(batch)
        state = self.decode_build_inference_state_(gpu_batch, max_ctx)

        def sample_per_request(logits: Tensor) -> list:
            self.outputs.append(logits.clone())
            return [int(logits[i].argmax()) for i in range(len(valid_decode))]     # greedy

        graph_idx = gpu_batch.n_sequences - 1
        if self.use_cuda_graphs and gpu_batch.n_sequences > 0 and graph_idx < MAX_BATCH:
            graph_runner = self.decode_graph_pool_[graph_idx]
            # Graph captures ONLY forward_logits -- sampling runs eager after
            logits_out = TensorHandle()
            graph_runner.set_decode_fn(lambda: self.executor_.forward_logits(state, logits_out))
            graph_runner.execute()                            # (return value ignored, as upstream)
            if logits_out.data is None:
                logits_out.data = self.executor_.get_logits_view(gpu_batch.n_sequences)
            return sample_per_request(logits_out.data)
        decode_logits_out = TensorHandle()
        self.executor_.forward_logits(state, decode_logits_out)
        return sample_per_request(decode_logits_out.data)

    def step_decode(self) -> None:
        valid_decode = [r for r in self.running if not r.finished()]
        tokens = self.step_decode_forward(valid_decode)
        for req, tok in zip(valid_decode, tokens):
            req.output_tokens.append(tok)
        self.outputs.append(_long(tokens, self.device))
        for req in valid_decode:
            if req.finished():
                self.kv_manager_.free_sequence(req.id)
        self.running = [r for r in self.running if not r.finished()]

    def step(self) -> bool:
        self.step_decode()
        return bool(self.running)


def serve(device, use_cuda_graphs: bool) -> list:
    engine = Engine(Model(device), device, use_cuda_graphs)
    if use_cuda_graphs:
        # (stand-in) the first replay after the size-1 capture fails to launch
        engine.decode_graph_pool_[0].set_fail_next_replay_for_test()
    for req in (Request("A", [3, 17, 5, 9, 1], 4), Request("B", [8, 2, 20, 11], 8)):
        engine.add_request(req)
        engine.step_prefill(req)
    while engine.step():
        pass
    return engine.outputs + [engine.kv_cache_raw_.clone()]


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graphs=True), lambda: serve(device, use_cuda_graphs=False))
