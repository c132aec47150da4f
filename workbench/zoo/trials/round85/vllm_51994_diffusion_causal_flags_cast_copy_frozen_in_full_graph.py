"""DiffusionGemma under FULL CUDA graphs: the per-request causal/bidirectional flags reach attention through a fresh int32 copy made by the metadata builder, so each captured graph keeps the capture-time flags.

Upstream: https://github.com/vllm-project/vllm/pull/51994 ("[Bugfix][Model] Fix DiffusionGemma silently freezing
attention mask under CUDA graph replay", merged 2026-09-30 as 1117140edb; files ``diffusion_gemma.py``,
``v1/attention/backends/flash_attn.py``, ``v1/attention/ops/triton_unified_attention.py``). Read: the PR description,
the regression test it adds (``test_causal_buf_survives_cudagraph_replay``: a bool ``_causal_buf`` is cast as
``build()`` casts it, a graph is captured over the cast, the buffer is then set and the replay still gives the
capture-time value), a stored upstream ``diffusion_gemma.py`` (``DiffusionGemmaModelState.__init__`` with
``_causal_buf = torch.zeros(max_num_reqs, dtype=torch.bool)``, ``prepare_attn``, ``prepare_dummy_inputs``), the
``build()`` lines of ``flash_attn.py`` (``if isinstance(causal, torch.Tensor) and causal.dtype != torch.int32:
causal = causal.to(torch.int32)``), MRV2's ``cudagraph_utils.py`` (``CudaGraphManager.capture_graph``,
``_capture_full_graph``, ``run_fullgraph``) and a downstream backport note of the fix. The merged diff itself was not
read: per the backport note it allocates ``_causal_buf`` as int32 and turns the builder's silent cast into an error.
Symptom: ``vllm serve google/diffusiongemma-26B-A4B-it`` (default O2: FULL_AND_PIECEWISE, FULL decode graphs):
requests served by a captured FULL graph get the causal/bidirectional pattern their slot had at capture (warmup:
all bidirectional) for the graph's whole life; commit (encoder) steps silently attend bidirectionally. Eager and
PIECEWISE (attention eager) are fine.
Mechanism: each DiffusionGemma request alternates between a commit step (causal attention over its canvas) and
denoise steps (bidirectional). ``DiffusionGemmaModelState.prepare_attn`` writes the per-request flags into the
persistent ``_causal_buf`` (bool) and passes the slice ``_causal_buf[:num_reqs]`` to ``build_attn_metadata``.
``FlashAttentionMetadataBuilder.build`` casts any non-int32 causal tensor with ``causal.to(torch.int32)``: a new
tensor on every call. ``CudaGraphManager.capture_graph`` builds the capture metadata the same way (dummy warmup
requests: every flag False), so the FULL graph's attention kernel is bound to that capture-time copy. At serving
time ``prepare_attn`` updates ``_causal_buf`` in place and ``build`` makes another copy, but ``run_fullgraph`` only
replays: the graph reads the copy it was captured with, never the live buffer. (That copy is released with the
capture metadata; the emulation keeps its bytes, as the block of a caching allocator does until it is handed on, so
a lifetime check would also see the read; the upstream test keeps the copy alive and sees the same frozen flags.)
Doctor: warmup-divergence, at build. Capture decided a tensor reference (the int32 copy made by ``build`` for the
capture metadata) that every replay reuses, while each eager step's ``build`` makes a new copy holding that step's
flags; the graph never reads the persistent buffer the step writes.
Fix (upstream): allocate ``_causal_buf`` as int32, so ``build`` passes the persistent buffer's slice through (the
cast is a no-op) and the captured kernel reads the live flags; ``build`` now refuses a non-int32 causal tensor
instead of silently copying it.
Modelled: ``DiffusionGemmaModelState`` (``__init__``'s buffers, ``prepare_inputs``, ``prepare_dummy_inputs``,
``prepare_attn``), ``FlashAttentionMetadataBuilder.build`` and ``build_attn_metadata``, a one-layer
``DiffusionGemmaForCausalLM`` whose ``FlashAttentionImpl`` applies the per-sequence (dynamic) causal flag to each
request's canvas (every request's cached prefix is always visible), MRV2's ``CudaGraphManager`` (FULL graphs keyed on
token count, capture of the largest size first, dummy capture batch, output buffer, ``run_fullgraph``) and a minimal
``GPUModelRunner.execute_model``. Stand-ins: the prefix KV cache is a per-slot buffer filled at admission (slot 0 is
the null block), the sampler and phase state machine are replaced by a scripted ``is_encoder_phase``. Sizes: hidden 8,
vocab 16 (float64), canvas 4 tokens, prefix up to 6, 4 request slots, FULL capture sizes 8 and 16 tokens.
Workload: requests A, B, C are admitted with cached prefixes of 5, 3 and 6 tokens. Step 1: A commits (causal), B
denoises (bidirectional): 8 tokens, the size-8 graph, whose capture-time flags are [0, 0], so A attends
bidirectionally. Step 2: A denoises, B and C commit: 3 requests padded to 4 (16 tokens), the size-16 graph with flags
[0, 0, 0, 0], so B and C are wrong. The fix equals eager in both steps.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/51994"
FAMILY = "warmup/capture vs replay state"
KIND = "warmup-divergence"
SITE = "build"
SYMPTOM = ("DiffusionGemma with FULL decode CUDA graphs: commit steps that need causal attention replay the "
           "capture-time (all-bidirectional) per-request causal flags, because the FlashAttention builder's int32 "
           "cast of the bool _causal_buf made a fresh copy that the graph captured; outputs differ from eager")

HIDDEN, VOCAB = 8, 16
CANVAS_LENGTH = 4               # uniform query length of a DiffusionGemma step
MAX_CTX = 6                     # longest cached prefix
MAX_NUM_REQS = 4
MAX_NUM_TOKENS = MAX_NUM_REQS * CANVAS_LENGTH
NUM_SLOTS = 1 + MAX_NUM_REQS    # slot 0: the null block
CUDAGRAPH_CAPTURE_SIZES = [8, 16]
LAYER = "model.layers.0.self_attn.attn"
FULL, NONE = "FULL", "NONE"

_variant = "bug"


# --- vllm/forward_context.py ---------------------------------------------------------------------------------

_forward_context: dict = {}


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    prev = dict(_forward_context)
    _forward_context["attn_metadata"] = attn_metadata
    try:
        yield
    finally:
        _forward_context.clear()
        _forward_context.update(prev)


def get_forward_context() -> dict:
    return _forward_context


# --- vllm/v1/attention/backends/flash_attn.py ----------------------------------------------------------------

@dataclasses.dataclass
class FlashAttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    causal: torch.Tensor            # per-sequence causal flag (int32), FA's dynamic causal


class FlashAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata: dict, causal=True) -> FlashAttentionMetadata:
        m = common_attn_metadata
        if isinstance(causal, torch.Tensor) and causal.dtype != torch.int32:
            if _variant == "fix":       # PR #51994: no silent out-of-place cast any more
                raise TypeError(f"per-sequence causal must be int32, got {causal.dtype}")
            causal = causal.to(torch.int32)     # a new tensor on every call
        return FlashAttentionMetadata(num_reqs=m["num_reqs"], num_actual_tokens=m["num_tokens"],
                                      seq_lens=m["seq_lens"], block_table=m["block_table"], causal=causal)


class FlashAttentionImpl:
    def forward(self, q, k, v, kv_cache, attn_metadata: FlashAttentionMetadata):
        """Each request: ``CANVAS_LENGTH`` queries over its cached prefix (always visible) and its canvas
        (causal or bidirectional per ``attn_metadata.causal``)."""
        md = attn_metadata
        r = md.num_reqs
        q, k, v = (t.view(r, CANVAS_LENGTH, HIDDEN) for t in (q, k, v))
        slots = md.block_table[:, 0]
        keys = torch.cat([kv_cache[0, slots], k], 1)                     # [R, MAX_CTX + C, D]
        vals = torch.cat([kv_cache[1, slots], v], 1)
        scores = torch.einsum("rid,rjd->rij", q, keys) * HIDDEN ** -0.5
        ctx_lens = md.seq_lens - CANVAS_LENGTH
        j = torch.arange(MAX_CTX, device=q.device)
        prefix_mask = (j.view(1, 1, -1) < ctx_lens.view(-1, 1, 1)).expand(r, CANVAS_LENGTH, MAX_CTX)
        i = torch.arange(CANVAS_LENGTH, device=q.device)
        lower = (i.view(1, -1, 1) >= i.view(1, 1, -1))
        bidirectional = (md.causal == 0).view(-1, 1, 1)
        canvas_mask = lower | bidirectional                              # [R, C, C]
        mask = torch.cat([prefix_mask, canvas_mask], 2)
        scores = scores.masked_fill(~mask, -1e9)
        out = torch.einsum("rij,rjd->rid", torch.softmax(scores, -1), vals)
        return out.reshape(r * CANVAS_LENGTH, HIDDEN)


# --- vllm/v1/worker/gpu/attn_utils.py ------------------------------------------------------------------------

def build_attn_metadata(attn_builders, num_reqs, num_tokens, seq_lens, block_tables, causal) -> dict:
    common = {"num_reqs": num_reqs, "num_tokens": num_tokens, "seq_lens": seq_lens, "block_table": block_tables}
    return {name: builder.build(0, common, causal=causal) for name, builder in attn_builders.items()}


# --- vllm/model_executor/models/diffusion_gemma.py -----------------------------------------------------------

class DiffusionGemmaForCausalLM:
    def __init__(self, device):
        gen = generator(51994)
        r = lambda *s, scale=0.5: randn(*s, gen=gen, device=device, scale=scale).double()  # noqa: E731
        self.embed_tokens = r(VOCAB, HIDDEN, scale=1.0)
        self.wq, self.wk, self.wv, self.wo = (r(HIDDEN, HIDDEN) for _ in range(4))
        self.lm_head = r(HIDDEN, VOCAB, scale=0.8)
        self.kv_cache = torch.zeros(2, NUM_SLOTS, MAX_CTX, HIDDEN, device=device, dtype=torch.float64)
        self.attn = FlashAttentionImpl()

    def embed_input_ids(self, input_ids):
        return self.embed_tokens[input_ids]

    def __call__(self, inputs_embeds):
        attn_metadata = get_forward_context()["attn_metadata"][LAYER]
        x = inputs_embeds
        o = self.attn.forward(x @ self.wq, x @ self.wk, x @ self.wv, self.kv_cache, attn_metadata)
        return x + o @ self.wo

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class DiffusionGemmaRequestStates:
    def __init__(self, max_num_reqs, device):
        self.is_encoder_phase = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)


class DiffusionGemmaModelState:
    def __init__(self, model, device):
        self.model = model
        self.max_num_reqs, self.max_num_tokens = MAX_NUM_REQS, MAX_NUM_TOKENS
        self.diffusion_states = DiffusionGemmaRequestStates(self.max_num_reqs, device)
        self.attn_builders = {LAYER: FlashAttentionMetadataBuilder()}
        # Persistent buffer for per-request causal flags, updated in-place
        # so FULL CUDA graph replay sees the latest values.
        causal_dtype = torch.int32 if _variant == "fix" else torch.bool      # PR #51994: int32
        self._causal_buf = torch.zeros(self.max_num_reqs, dtype=causal_dtype, device=device)
        # Persistent inputs_embeds buffer: capture and runtime point at the same memory.
        self._inputs_embeds_buf = torch.zeros(self.max_num_tokens, HIDDEN, device=device, dtype=torch.float64)

    def prepare_inputs(self, input_batch) -> dict:
        inputs_embeds = self._inputs_embeds_buf[:input_batch.num_tokens_after_padding]
        inputs_embeds[:input_batch.num_tokens].copy_(self.model.embed_input_ids(input_batch.input_ids))
        return {"inputs_embeds": inputs_embeds}

    def prepare_dummy_inputs(self, num_reqs, num_tokens) -> dict:
        return {"inputs_embeds": self._inputs_embeds_buf[:num_tokens]}

    def prepare_attn(self, input_batch, cudagraph_mode, input_buffers, for_capture=False) -> dict:
        if cudagraph_mode == FULL:
            num_reqs = input_batch.num_reqs_after_padding
            num_tokens = input_batch.num_tokens_after_padding
        else:
            num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        # Per-request causal mode: encoder (commit) = causal, denoise = bidirectional.
        actual_num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping[:actual_num_reqs]
        self._causal_buf[:actual_num_reqs] = self.diffusion_states.is_encoder_phase[slots]
        if actual_num_reqs < num_reqs:
            self._causal_buf[actual_num_reqs:num_reqs] = False
        causal = self._causal_buf[:num_reqs]
        return build_attn_metadata(self.attn_builders, num_reqs, num_tokens, input_buffers.seq_lens[:num_reqs],
                                   input_buffers.block_table[:num_reqs], causal=causal)


# --- vllm/v1/worker/gpu: input buffers, CudaGraphManager, runner ---------------------------------------------

class InputBuffers:
    def __init__(self, device):
        self.seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(MAX_NUM_REQS, 1, dtype=torch.int64, device=device)


@dataclasses.dataclass
class InputBatch:
    num_reqs: int
    num_reqs_after_padding: int
    num_tokens: int
    num_tokens_after_padding: int
    idx_mapping: torch.Tensor
    input_ids: torch.Tensor


class CudaGraphManager:
    def __init__(self, device):
        self.device = device
        self.graphs: dict[int, object] = {}
        self.pool = graph_pool_handle(device)
        self.hidden_states: torch.Tensor | None = None

    def get_cudagraph_size(self, num_tokens):
        return next((s for s in CUDAGRAPH_CAPTURE_SIZES if s >= num_tokens), None)

    def capture_graph(self, num_tokens, model, model_state, input_buffers):
        num_reqs = num_tokens // CANVAS_LENGTH
        # dummy capture batch: warmup requests never went through the phase state machine
        dummy = InputBatch(num_reqs, num_reqs, num_tokens, num_tokens,
                           torch.arange(num_reqs, device=self.device), torch.zeros(0, dtype=torch.int64))
        input_buffers.seq_lens[:num_reqs] = CANVAS_LENGTH
        input_buffers.seq_lens[num_reqs:] = 0
        input_buffers.block_table.zero_()
        model_inputs = model_state.prepare_dummy_inputs(num_reqs, num_tokens)
        attn_metadata = model_state.prepare_attn(dummy, FULL, input_buffers, for_capture=True)
        if self.hidden_states is None:
            self.hidden_states = torch.zeros(MAX_NUM_TOKENS, HIDDEN, device=self.device, dtype=torch.float64)

        def forward():
            with set_forward_context(attn_metadata):
                hidden_states = model(**model_inputs)
            self.hidden_states[:num_tokens] = hidden_states
            return self.hidden_states[:num_tokens]

        g, out = capture(forward, device=self.device, pool=self.pool, name=f"FULL {num_tokens} tokens",
                         owner="CudaGraphManager (FULL)", on_freed="reuse",
                         static={"inputs_embeds": model_state._inputs_embeds_buf, "seq_lens": input_buffers.seq_lens,
                                 "block_table": input_buffers.block_table, "_causal_buf": model_state._causal_buf},
                         state={"kv_cache": model.kv_cache})
        self.graphs[num_tokens] = (g, out)

    def capture(self, model, model_state, input_buffers):
        for size in sorted(CUDAGRAPH_CAPTURE_SIZES, reverse=True):     # capture larger graphs first
            self.capture_graph(size, model, model_state, input_buffers)

    def run_fullgraph(self, num_tokens, real_tokens, padded):
        g, out = self.graphs[num_tokens]
        return replay(g, out, real=real_tokens, size=num_tokens, padded=padded)


class GPUModelRunner:
    def __init__(self, device, use_cuda_graph):
        self.device = device
        self.model = DiffusionGemmaForCausalLM(device)
        self.model_state = DiffusionGemmaModelState(self.model, device)
        self.input_buffers = InputBuffers(device)
        self.cudagraph_manager = CudaGraphManager(device) if use_cuda_graph else None
        if use_cuda_graph:
            self.cudagraph_manager.capture(self.model, self.model_state, self.input_buffers)

    def add_request(self, req_index, prefix_k, prefix_v):
        n = prefix_k.shape[0]
        self.model.kv_cache[0, req_index + 1, :n] = prefix_k
        self.model.kv_cache[1, req_index + 1, :n] = prefix_v

    def execute_model(self, req_indices, ctx_lens, input_ids):
        num_reqs = len(req_indices)
        num_tokens = num_reqs * CANVAS_LENGTH
        size = self.cudagraph_manager.get_cudagraph_size(num_tokens) if self.cudagraph_manager else None
        cg_mode = FULL if size is not None else NONE
        num_tokens_padded = size if size is not None else num_tokens
        batch = InputBatch(num_reqs, num_tokens_padded // CANVAS_LENGTH, num_tokens, num_tokens_padded,
                           torch.tensor(req_indices, device=self.device), input_ids)
        bufs = self.input_buffers
        bufs.seq_lens.zero_()
        bufs.seq_lens[:num_reqs] = torch.tensor(ctx_lens, device=self.device) + CANVAS_LENGTH
        bufs.block_table.zero_()                               # padded requests: the null block
        bufs.block_table[:num_reqs, 0] = batch.idx_mapping + 1
        model_inputs = self.model_state.prepare_inputs(batch)
        attn_metadata = self.model_state.prepare_attn(batch, cg_mode, bufs)
        if cg_mode == FULL:
            hidden_states = self.cudagraph_manager.run_fullgraph(
                size, num_tokens, padded={"inputs_embeds": self.model_state._inputs_embeds_buf[:size]})
        else:
            with set_forward_context(attn_metadata):
                hidden_states = self.model(**model_inputs)
        return self.model.compute_logits(hidden_states[:num_tokens]).clone()


# --- the workload --------------------------------------------------------------------------------------------

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(2026)
    ctx_lens = {0: 5, 1: 3, 2: 6}                                       # A, B, C
    prefixes = {i: (randn(MAX_CTX, HIDDEN, gen=gen, device=device).double(),
                    randn(MAX_CTX, HIDDEN, gen=gen, device=device).double()) for i in ctx_lens}
    # (requests, is_encoder_phase per request) for each step
    steps = [([0, 1], [True, False]), ([0, 1, 2], [False, True, True])]
    step_ids = [torch.randint(0, VOCAB, (len(reqs) * CANVAS_LENGTH,), generator=gen).to(device)
                for reqs, _ in steps]

    def serve(use_cuda_graph):
        runner = GPUModelRunner(device, use_cuda_graph)
        for i, n in ctx_lens.items():
            runner.add_request(i, prefixes[i][0][:n], prefixes[i][1][:n])
        outs = []
        for (reqs, phases), ids in zip(steps, step_ids):
            for req, phase in zip(reqs, phases):                         # the sampler's phase bookkeeping
                runner.model_state.diffusion_states.is_encoder_phase[req] = phase
            outs.append(runner.execute_model(reqs, [ctx_lens[r] for r in reqs], ids))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
