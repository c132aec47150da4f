"""vLLM's Model Runner V2 profiles CUDA-graph memory before the real KV cache exists: it bootstraps a minimal KV
cache, runs ``capture_model()`` once and throws the graphs away. ``profile_cudagraph_memory`` pointed the decoder's
``CudaGraphManager`` at a throwaway pool, but the speculator's cudagraph managers are
created *inside* that profiling bootstrap (``initialize_kv_cache`` calls ``speculator.init_cudagraph_manager``) and
bind ``current_platform.get_global_graph_pool()`` when they are built, so the speculator's profiling graphs went
into the persistent global pool. The profiling teardown did not drop them; the real ``initialize_kv_cache`` did, by
building fresh speculator managers. That released the last graphs of the global pool, and the real capture, which
re-opens that pool, hit the allocator's ``use_count > 0`` assert. The fix points the platform's global-pool
singleton at a throwaway pool for the whole profiling phase (so managers built during it bind the throwaway one),
and drops the speculator's profiling managers at teardown.

Upstream: https://github.com/vllm-project/vllm/pull/53682 ("[Bugfix][MRV2] Run cudagraph memory profiling in a
throwaway graph pool", vllm-project/vllm, author njhill, description dated 2026-08-25, merged; merge commit not
known to me). It fixes issue #53679 ("DSpark/DFlash speculator CUDA graph capture crashes with 'CachingHostAllocator
use_count > 0 INTERNAL ASSERT FAILED' after memory profiling"), a regression of #53306 ("[Model Runner V2] Reserve
CUDA graph memory", a4d70bef3, 2026-08-23, per the issue). Read: the PR description; the issue's description and
its root-cause comment ("profile_cudagraph_memory() redirects only the main model's CudaGraphManager to the
throwaway graph pool, while speculative decoders such as DFlash/DSpark and AutoRegressive own additional CUDA graph
managers ... Those profiling graphs can therefore be captured into the persistent global pool and later released");
the competing, closed PR #53725's description (the same diagnosis); the fixed
``vllm/v1/worker/gpu/cudagraph_utils.py`` in a stored copy whose repository the index does not show, carrying the
PR's text verbatim (``profile_cudagraph_memory(runner)``: ``saved_global_pool``/``throwaway_pool`` swapped into
``type(current_platform)._global_graph_pool``, ``manager.pool = throwaway_pool``, wrapper pools swapped,
``spec_manager_names`` found with ``vars(speculator)`` and set to ``None`` in the ``finally``;
``_init_minimal_kv_cache_for_profiling``, ``_teardown_profiling_state``, ``_extrapolate_full_graph_memory``) and the
fixed unit tests (``test_profile_cudagraph_memory_redirects_wrapper_pools``,
``test_profile_cudagraph_memory_swaps_and_drops_speculator_managers``); from vllm main at ffd91ee (2026-08-22, a
mirror of jsboige/vllm, before #53306, when MRV2's ``profile_cudagraph_memory`` still returned 0):
``Platform.get_global_graph_pool``, ``CudaGraphManager.__init__`` (``self.pool =
current_platform.get_global_graph_pool() if cudagraph_mode else None``) and ``capture``,
``ModelCudaGraphManager.capture``/``run_fullgraph``, ``DFlashCudaGraphManager``, ``SpeculatorCudaGraphManager``,
``DFlashSpeculator.init_cudagraph_manager``/``capture``/``_generate_draft``, ``GPUModelRunner.initialize_kv_cache``
(builds ``ModelCudaGraphManager``, then ``self.speculator.init_cudagraph_manager(cudagraph_mode)``) and
``capture_model`` (``gc.collect()``, decoder capture, ``self.speculator.capture()``), and ``gpu_worker``'s call
sites; torch 2.13's ``ATen/core/CachingHostAllocator.h`` (``release_pool``, ``create_or_incref_pool_under_lock``,
``empty_cache``).
Not read: the PR's diff page, and the pre-fix (#53306) ``profile_cudagraph_memory`` itself: its shape here is my
reconstruction from the issue's root cause, the fixed function and its comments, and a later stored copy (repository
not shown) whose comment "Capture all profiling graphs into a throwaway pool so their memory is reclaimed on
teardown rather than retained by the persistent global pool (which the real capture reuses)" I take for #53306's;
#53306's description; follow-up #53955; ``CUDAGraphWrapper``/breakable runners; the DSpark/MTP speculators and the
DeepSeek-V4 model; the real-run traceback beyond the assert line.
Symptom: "vLLM crashes during real CUDA graph capture when DSpark/DFlash speculative decoding is enabled:
CachingHostAllocator.h:815: TORCH_INTERNAL_ASSERT(it->second->use_count > 0) failed" (issue #53679); the PR: "the
nightly B200 DeepSeek-V4-Flash failure after #53306 ... crashes before this change, engine initializes cleanly with
it". Without CUDA graphs nothing is profiled or captured, and the engine serves.
Mechanism: ``Worker.determine_available_memory`` -> ``profile_cudagraph_memory``: the profiling
``initialize_kv_cache`` builds the decoder manager (bound to the global pool G, created lazily here) and the
speculator's ``DFlashCudaGraphManager`` (bound to G); the decoder manager is switched to a throwaway pool, the
speculator's is not, so ``capture_model`` captures the draft graph into G; teardown drops the decoder manager only.
``initialize_from_config`` -> the real ``initialize_kv_cache`` replaces the speculator's manager, releasing G's only
graph; ``compile_or_warm_up_model`` -> ``capture_model`` captures the decoder into G, which the allocator refuses.
Doctor: dangling-reference, at profile_cudagraph_memory. The real capture is handed a pool handle whose owning graphs
were all released (the allocator's ``use_count > 0`` assert), as in ``trtllm_16952`` and ``stablefast_57bc423``; the
decision that put the profiling speculator graphs into the persistent pool, and let them outlive profiling, is made
in ``profile_cudagraph_memory``, the function the fix changes (``GPUModelRunner.profile_cudagraph_memory`` only
delegates to it, as upstream's does).
Fix (upstream): in ``profile_cudagraph_memory``, ``platform_cls._global_graph_pool = throwaway_pool`` around the
whole phase (restored in ``finally``), ``manager.pool = throwaway_pool``, and ``setattr(speculator, name, None)`` for
every ``CudaGraphManager`` attribute of the speculator before ``_teardown_profiling_state``.
Modelled: ``Platform`` (``_global_graph_pool``, ``graph_pool_handle``, ``get_global_graph_pool``),
``current_platform``, ``BatchExecutionDescriptor``, ``CudaGraphManager`` (``pool``, ``needs_capture``, ``capture``,
``dispatch``, ``run_fullgraph``), ``ModelCudaGraphManager``, ``DFlashCudaGraphManager``,
``_init_minimal_kv_cache_for_profiling``, ``_teardown_profiling_state``, ``profile_cudagraph_memory``,
``DFlashSpeculator`` (``init_cudagraph_manager``, ``capture``, ``_generate_draft``, ``propose``), ``GPUModelRunner``
(``initialize_kv_cache``, ``capture_model``, ``profile_cudagraph_memory``, ``execute_model``), ``Worker``
(``determine_available_memory``, ``initialize_from_config``, ``compile_or_warm_up_model``).
Stand-ins: upstream's refused pool was the pinned-host allocator's: its ``release_pool`` keeps a pool whose last
graph went (``use_count`` 0) until the host ``empty_cache``, so the next capture given its id asserts with nothing
held. The CPU emulation models the device allocator, which refuses the handle only while memory the pool allocated is
still held; so here the draft graph's output (the draft tokens, allocated by the capture) is kept by the speculator,
which reads it after each replay (upstream writes draft tokens into ``self.draft_tokens``, a buffer made outside the
capture; which pinned block the host pool held, if any, I did not find). One FULL_DECODE_ONLY size per manager (2
requests), no piecewise wrappers, breakable runners, LoRA, DP or memory extrapolation (the estimate is the free-memory
delta on CUDA, 0 on the CPU, and does not size the KV cache); KV cache: one slot per request plus a null slot the
dummy batches write (vLLM's null block), contiguous per slot instead of paged; the drafter is a two-step recurrent
MLP over the target's last hidden state, not DFlash's attention model; prefill runs eagerly (FULL_DECODE_ONLY).
Workload: 2 layers, width 16, vocab 16; prompts of 4 and 5 tokens prefilled eagerly; 4 speculative steps (2 draft
tokens a request, verified by the target in one 6-token decode graph, greedy acceptance). Outputs: prefill logits,
then each step's draft tokens, target logits and accepted counts.
Measured: the check printed
  vllm_53682_mrv2_profiling_speculator_graphs_release_global_pool [bug] on cpu: misbehaves (raised GraphError:
  capture into a graph pool whose graphs have all been reset or dropped while memory it allocated is still held (a
  graph's output): CUDA's caching allocator refuses the handle (INTERNAL ASSERT use_count > 0). Take a fresh
  graph_pool_handle() for the new captures, keep one graph of the pool alive until they are captured, or let go of
  the old outputs first.)
  vllm_53682_mrv2_profiling_speculator_graphs_release_global_pool [fix] on cpu: equals eager (max |graph - eager| = 0)
The bug raises in the real ``capture_model``, at the decoder's capture into the global pool. Both variants together
take about 7 s on the CPU, imports included.
"""
from __future__ import annotations

import enum
import gc
from dataclasses import dataclass

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, remember_step, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/53682"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "profile_cudagraph_memory"
SYMPTOM = ("with a speculator, the engine's first real CUDA graph capture fails (INTERNAL ASSERT use_count > 0): "
           "memory profiling captured the speculator's graphs into the persistent global graph pool, and the real "
           "initialize_kv_cache released them, so no graph holds that pool when the real capture re-opens it")

DTYPE = torch.float64
VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 16, 16, 2, 8, 2
MAX_MODEL_LEN, MAX_NUM_REQS = 24, 2
NULL_SLOT = MAX_NUM_REQS                    # the dummy batch's slot (vLLM's null block): no request owns it
NUM_SPECULATIVE_STEPS = 2
DECODE_QUERY_LEN = NUM_SPECULATIVE_STEPS + 1
PROMPTS = ([3, 1, 5, 2], [6, 2, 7, 1, 4])
STEPS = 4
_variant = "bug"


class CUDAGraphMode(enum.Enum):
    NONE = 0
    FULL_DECODE_ONLY = 1


# --- vllm/platforms/interface.py ---------------------------------------------------------------------------------

class Platform:
    _global_graph_pool = None
    device = "cpu"

    def graph_pool_handle(self):
        return graph_pool_handle(self.device)

    def get_global_graph_pool(self):
        """Return the global graph pool for this platform."""
        cls = self.__class__
        if cls._global_graph_pool is None:
            cls._global_graph_pool = self.graph_pool_handle()
        return cls._global_graph_pool


current_platform = Platform()


def _free_memory(device) -> int:
    return torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else 0


# --- vllm/v1/worker/gpu/cudagraph_utils.py -----------------------------------------------------------------------

@dataclass(frozen=True)
class BatchExecutionDescriptor:
    num_tokens: int
    num_reqs: int


class CudaGraphManager:
    def __init__(self, device, cudagraph_mode: CUDAGraphMode, decode_query_len: int, name: str):
        self.device, self.cudagraph_mode, self.name = device, cudagraph_mode, name
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = current_platform.get_global_graph_pool() if cudagraph_mode != CUDAGraphMode.NONE else None
        self._capture_descs = ([BatchExecutionDescriptor(MAX_NUM_REQS * decode_query_len, MAX_NUM_REQS)]
                               if cudagraph_mode != CUDAGraphMode.NONE else [])
        self._graphs_captured = False

    def needs_capture(self) -> bool:
        return len(self._capture_descs) > 0

    def capture(self, create_forward_fn, static: dict, state: dict | None = None) -> None:
        events.static_buffers(self.name, static)
        if state:
            events.persistent_state(self.name, state)
        for desc in self._capture_descs:
            forward_fn = create_forward_fn(desc, warmup=True)
            with events.warmup():
                forward_fn()                                    # Warmup
            forward_fn = create_forward_fn(desc, warmup=False)  # Capture with fresh inputs.
            g = new_graph(self.device)
            with graph(g, self.pool, name=f"{self.name} {desc.num_tokens} tokens"):
                self.outputs[desc] = forward_fn()
            remember_step(g, forward_fn)
            self.graphs[desc] = g
        self._graphs_captured = True

    def dispatch(self, num_reqs: int, num_tokens: int) -> BatchExecutionDescriptor | None:
        if not self._graphs_captured:
            return None
        return next((d for d in self._capture_descs if d.num_reqs == num_reqs and d.num_tokens == num_tokens), None)

    def run_fullgraph(self, desc: BatchExecutionDescriptor):
        return replay(self.graphs[desc], self.outputs[desc])


class ModelCudaGraphManager(CudaGraphManager):
    """CudaGraphManager with model-specific capture and hidden state management."""

    def __init__(self, device, cudagraph_mode, decode_query_len):
        super().__init__(device, cudagraph_mode, decode_query_len, "ModelCudaGraphManager")
        self.hidden_states: torch.Tensor | None = None

    def capture(self, model, input_buffers: dict, kv_caches: list) -> None:
        def create_forward_fn(desc, warmup):
            n = desc.num_tokens                                 # dummy batch, prepared outside the graph
            input_buffers["input_ids"][:n].zero_()
            input_buffers["positions"][:n].zero_()
            input_buffers["req_indices"][:n].fill_(NULL_SLOT)

            def forward_fn():
                hidden_states = model.forward(input_buffers["input_ids"][:n], input_buffers["positions"][:n],
                                              input_buffers["req_indices"][:n])
                if self.hidden_states is None:
                    self.hidden_states = torch.empty_like(hidden_states)
                self.hidden_states[:n] = hidden_states
                return self.hidden_states
            return forward_fn

        super().capture(create_forward_fn, static=dict(input_buffers),
                        state={f"kv_caches[{i}].{kv}": t for i, pair in enumerate(kv_caches)
                               for kv, t in zip("kv", pair)})


class DFlashCudaGraphManager(CudaGraphManager):
    """DFlash CudaGraphManager for the parallel-drafting query forward."""

    def __init__(self, device, cudagraph_mode):
        super().__init__(device, cudagraph_mode, 1, "DFlashCudaGraphManager")


def _init_minimal_kv_cache_for_profiling(runner) -> None:
    """Allocate the smallest KV cache that still lets every graph be captured."""
    runner.initialize_kv_cache(num_slots=MAX_NUM_REQS + 1, is_profiling=True)


def _teardown_profiling_state(runner) -> None:
    """Release the profiling KV cache and captured graphs while keeping model weights."""
    runner.kv_caches.clear()
    # Dropping the manager releases the profiling graphs and throwaway pool.
    runner.cudagraph_manager = None
    for layer in runner.model.layers:                   # Detach profiling KV tensors held by attention layers.
        layer.kv_cache = ()
    gc.collect()


@torch.inference_mode()
def profile_cudagraph_memory(runner) -> int:
    """Estimate the GPU memory needed for CUDA graph capture, before the real KV cache is allocated:
    bootstrap a minimal KV cache, run capture_model() once, release everything."""
    if runner.cudagraph_mode == CUDAGraphMode.NONE:
        return 0
    gc.collect()
    if _variant == "bug":
        _init_minimal_kv_cache_for_profiling(runner)
        manager = runner.cudagraph_manager
        try:
            if not manager.needs_capture():
                return 0
            # Capture all profiling graphs into a throwaway pool so their memory is reclaimed on teardown
            # rather than retained by the persistent global pool (which the real capture reuses).
            manager.pool = current_platform.graph_pool_handle()
            return int(runner.capture_model())
        finally:
            del manager
            _teardown_profiling_state(runner)
    # Run the whole profiling phase against a throwaway CUDA graph pool by pointing the global graph pool
    # singleton at it: objects that bind the pool lazily during profiling (speculator cudagraph managers) then
    # land on the throwaway pool too.
    platform_cls = type(current_platform)
    saved_global_pool = platform_cls._global_graph_pool
    throwaway_pool = current_platform.graph_pool_handle()
    platform_cls._global_graph_pool = throwaway_pool
    try:
        _init_minimal_kv_cache_for_profiling(runner)
        manager = runner.cudagraph_manager
        speculator = runner.speculator
        spec_manager_names: list[str] = []
        try:
            if not manager.needs_capture():
                return 0
            manager.pool = throwaway_pool
            if speculator is not None:
                spec_manager_names = [name for name, value in vars(speculator).items()
                                      if isinstance(value, CudaGraphManager)]
            return int(runner.capture_model())
        finally:
            # Drop the speculator's cudagraph managers; the real initialize_kv_cache re-creates them. Their
            # profiling graphs release the throwaway pool here rather than after the real init.
            for name in spec_manager_names:
                setattr(speculator, name, None)
            del manager
            _teardown_profiling_state(runner)
    finally:
        platform_cls._global_graph_pool = saved_global_pool


# --- the model and the DFlash-style speculator ---------------------------------------------------------------

def _weights(gen, device, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale / shape[0] ** 0.5).to(device)


class DecoderLayer:
    def __init__(self, gen, device):
        self.wqkv = _weights(gen, device, HIDDEN, 3 * HEADS * HEAD_DIM)
        self.wo = _weights(gen, device, HEADS * HEAD_DIM, HIDDEN)
        self.w1, self.w2 = _weights(gen, device, HIDDEN, 2 * HIDDEN), _weights(gen, device, 2 * HIDDEN, HIDDEN)
        self.kv_cache: tuple = ()                       # bound by initialize_kv_cache (init_kv_cache upstream)

    def forward(self, h, positions, req_indices):
        k_cache, v_cache = self.kv_cache
        q, k, v = (torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.wqkv).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        k_cache.index_put_((req_indices, positions), k)                       # the KV store (slot mapping)
        v_cache.index_put_((req_indices, positions), v)
        keys, values = k_cache[req_indices], v_cache[req_indices]             # [T, L, H, D]
        scores = torch.einsum("thd,tlhd->thl", q, keys) / HEAD_DIM ** 0.5
        visible = torch.arange(MAX_MODEL_LEN, device=h.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        h = h + torch.einsum("thl,tlhd->thd", torch.softmax(scores, -1), values).reshape(-1, HEADS * HEAD_DIM) @ self.wo
        return h + torch.nn.functional.silu(torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.w1) @ self.w2


class Model:
    def __init__(self, device):
        gen = generator(53682)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.pos_embed = (0.5 * torch.randn(MAX_MODEL_LEN, HIDDEN, generator=gen, dtype=DTYPE)).to(device)
        self.layers = [DecoderLayer(gen, device) for _ in range(LAYERS)]
        self.lm_head = _weights(gen, device, HIDDEN, VOCAB)

    def forward(self, input_ids, positions, req_indices):
        h = self.embed[input_ids] + self.pos_embed[positions]
        for layer in self.layers:
            h = layer.forward(h, positions, req_indices)
        return torch.nn.functional.rms_norm(h, (HIDDEN,))

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


class DFlashSpeculator:
    """Proposes NUM_SPECULATIVE_STEPS draft tokens per request from the target's last hidden state."""

    def __init__(self, device):
        gen = generator(10)
        self.device = device
        self.w_h, self.w_r = _weights(gen, device, HIDDEN, HIDDEN), _weights(gen, device, HIDDEN, HIDDEN)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=DTYPE).to(device)
        self.w_out = _weights(gen, device, HIDDEN, VOCAB, scale=3.0)
        self.hidden_states = torch.zeros(MAX_NUM_REQS, HIDDEN, dtype=DTYPE, device=device)
        self.last_sampled = torch.zeros(MAX_NUM_REQS, dtype=torch.long, device=device)
        self.query_cudagraph_manager: DFlashCudaGraphManager | None = None
        self.draft_tokens: torch.Tensor | None = None

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        self.query_cudagraph_manager = DFlashCudaGraphManager(self.device, cudagraph_mode)

    def _generate_draft(self, num_reqs: int) -> torch.Tensor:
        h = torch.tanh(self.hidden_states[:num_reqs] @ self.w_h + self.embed[self.last_sampled[:num_reqs]])
        draft = []
        for _ in range(NUM_SPECULATIVE_STEPS):
            token = (h @ self.w_out).argmax(-1)
            draft.append(token)
            h = torch.tanh(h @ self.w_r + self.embed[token])
        return torch.stack(draft, 1)

    def capture(self) -> None:
        def create_forward_fn(desc, warmup):
            self.hidden_states.zero_()                  # padded sample rows must not hit a live request
            self.last_sampled.zero_()
            return lambda: self._generate_draft(desc.num_reqs)

        manager = self.query_cudagraph_manager
        manager.capture(create_forward_fn, static={"hidden_states": self.hidden_states,
                                                   "last_sampled": self.last_sampled})
        # (stand-in) the speculator reads its draft tokens from the captured query forward's output.
        self.draft_tokens = next(iter(manager.outputs.values()))

    def propose(self, last_hidden_states, last_sampled) -> torch.Tensor:
        n = last_hidden_states.shape[0]
        self.hidden_states[:n].copy_(last_hidden_states)
        self.last_sampled[:n].copy_(last_sampled)
        manager = self.query_cudagraph_manager
        desc = manager.dispatch(n, n) if manager is not None else None
        if desc is not None:
            return manager.run_fullgraph(desc)[:n].clone()
        return self._generate_draft(n)


# --- vllm/v1/worker/gpu/model_runner.py, gpu_worker.py -------------------------------------------------------------

class GPUModelRunner:
    def __init__(self, model, speculator, device, enforce_eager: bool):
        self.model, self.speculator, self.device = model, speculator, device
        self.cudagraph_mode = CUDAGraphMode.NONE if enforce_eager else CUDAGraphMode.FULL_DECODE_ONLY
        n = MAX_NUM_REQS * DECODE_QUERY_LEN
        self.input_buffers = {name: torch.zeros(n, dtype=torch.long, device=device)
                              for name in ("input_ids", "positions", "req_indices")}
        self.cudagraph_manager: ModelCudaGraphManager | None = None
        self.kv_caches: list = []

    def initialize_kv_cache(self, num_slots: int, is_profiling: bool = False) -> None:
        shape = (num_slots, MAX_MODEL_LEN, HEADS, HEAD_DIM)
        self.kv_caches = [(torch.zeros(shape, dtype=DTYPE, device=self.device),
                           torch.zeros(shape, dtype=DTYPE, device=self.device)) for _ in self.model.layers]
        for layer, kv_cache in zip(self.model.layers, self.kv_caches):
            layer.kv_cache = kv_cache
        self.cudagraph_manager = ModelCudaGraphManager(self.device, self.cudagraph_mode, DECODE_QUERY_LEN)
        if self.speculator is not None:
            self.speculator.init_cudagraph_manager(self.cudagraph_mode)

    @torch.inference_mode()
    def capture_model(self) -> int:
        if not self.cudagraph_manager.needs_capture():
            return 0
        gc.collect()
        start_free_gpu_memory = _free_memory(self.device)
        self.cudagraph_manager.capture(self.model, self.input_buffers, self.kv_caches)
        if self.speculator is not None:
            self.speculator.capture()
        return start_free_gpu_memory - _free_memory(self.device)

    def profile_cudagraph_memory(self) -> int:
        return profile_cudagraph_memory(self)

    def execute_model(self, input_ids, positions, req_indices, num_reqs: int) -> torch.Tensor:
        n = input_ids.shape[0]
        desc = self.cudagraph_manager.dispatch(num_reqs, n)
        if desc is None:                                # eager (prefill, or no graphs)
            return self.model.forward(input_ids, positions, req_indices)
        for name, t in (("input_ids", input_ids), ("positions", positions), ("req_indices", req_indices)):
            self.input_buffers[name][:n].copy_(t)
        return self.cudagraph_manager.run_fullgraph(desc)[:n]


class Worker:
    def __init__(self, model_runner: GPUModelRunner):
        self.model_runner = model_runner

    def determine_available_memory(self) -> int:
        return -self.model_runner.profile_cudagraph_memory()    # (stand-in: the KV cache size is fixed)

    def initialize_from_config(self) -> None:
        self.model_runner.initialize_kv_cache(num_slots=MAX_NUM_REQS + 1)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.capture_model()


# --- engine --------------------------------------------------------------------------------------------------------

def _long(xs, device):
    return torch.tensor(xs, dtype=torch.long).to(device)


def serve(device, enforce_eager: bool) -> list:
    Platform._global_graph_pool = None                 # a fresh engine process
    Platform.device = device
    model, speculator = Model(device), DFlashSpeculator(device)
    runner = GPUModelRunner(model, speculator, device, enforce_eager)
    worker = Worker(runner)
    worker.determine_available_memory()
    worker.initialize_from_config()
    worker.compile_or_warm_up_model()

    outputs, last_hidden, last_sampled, seq_lens = [], [], [], []
    for slot, prompt in enumerate(PROMPTS):             # prefill, eagerly (FULL_DECODE_ONLY)
        length = len(prompt)
        hidden = runner.execute_model(_long(prompt, device), torch.arange(length, device=device),
                                      _long([slot] * length, device), num_reqs=1)
        logits = model.compute_logits(hidden[-1:])
        outputs.append(logits.clone())
        last_hidden.append(hidden[-1].clone())
        last_sampled.append(int(logits.argmax()))
        seq_lens.append(length)
    for _ in range(STEPS):                              # speculative decode: draft, then verify
        draft = speculator.propose(torch.stack(last_hidden), _long(last_sampled, device))
        drafts = draft.tolist()
        ids = [t for r in range(MAX_NUM_REQS) for t in [last_sampled[r]] + drafts[r]]
        positions = [s + j for s in seq_lens for j in range(DECODE_QUERY_LEN)]
        req_indices = [r for r in range(MAX_NUM_REQS) for _ in range(DECODE_QUERY_LEN)]
        hidden = runner.execute_model(_long(ids, device), _long(positions, device), _long(req_indices, device),
                                      num_reqs=MAX_NUM_REQS)
        logits = model.compute_logits(hidden)
        outputs += [draft.clone(), logits.clone()]
        greedy = logits.argmax(-1).view(MAX_NUM_REQS, DECODE_QUERY_LEN).tolist()
        accepted = []
        for r in range(MAX_NUM_REQS):
            n = 0
            while n < NUM_SPECULATIVE_STEPS and greedy[r][n] == drafts[r][n]:
                n += 1
            accepted.append(n)
            last_sampled[r] = greedy[r][n]
            last_hidden[r] = hidden[r * DECODE_QUERY_LEN + n].clone()
            seq_lens[r] += n + 1
        outputs.append(_long(accepted, device))
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, enforce_eager=False), lambda: serve(device, enforce_eager=True))
