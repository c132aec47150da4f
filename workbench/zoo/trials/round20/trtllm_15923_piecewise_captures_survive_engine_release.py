"""Piecewise captures survive the phase-1 executor teardown: the final executor replays graphs reading freed inputs.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/15923 (commit 211482b; title not available to me: the fix for
nvbug 6305365 as cited by https://github.com/NVIDIA/TensorRT-LLM/pull/16591, "[https://nvbugs/6305365][chore] Unwaive
piecewise cudagraph related tests").
Symptom: with torch.compile piecewise CUDA graphs on (``enable_piecewise_cuda_graph``), DeepSeek-V3-Lite and
Llama-3.1-8B bf16 accuracy tests failed with ``cudaErrorLaunchFailure`` during the attention warmup of the executor
that is created after the KV-cache-estimation (phase-1) executor is torn down (TensorRT-LLM main, July 2026).
Mechanism: the compiled model's ``Backend`` owns the ``PiecewiseRunner`` pieces, and it outlives a ``ModelEngine`` /
``PyExecutor``. A runner keeps, per captured token count, the ``Entry`` with its ``cuda_graph``, the static ``output``
and the input/output addresses; once ``entry.cuda_graph`` is set, every later call just replays it and returns
``entry.output`` -- it never checks that the arguments still live where they lived at capture (only a debug assert
does). ``ModelEngine._release_cuda_graphs()`` released the regular ``CUDAGraphRunner`` graphs at phase-1 shutdown but
not the piecewise captures. So the final executor's warmup replayed pieces captured against the phase-1 engine's
input buffers, freed with that engine (and their memory reused by the final KV-cache allocation): the piece reads
freed memory (a launch failure on the GPU, garbage when the block was reused) and hands out the stale static output.
Doctor: dangling-reference, at ``_release_cuda_graphs`` (it releases the phase-1 graph state but leaves the piecewise
captures alive, so the final executor replays graphs whose input memory the phase-1 engine has released).
Fix (upstream): ``ModelEngine._release_cuda_graphs()`` also calls ``Backend.clear_piecewise_cuda_graphs()``, which
resets every tracked ``PiecewiseRunner`` capture (graph, warmup count, input/output addresses, static output) and
rotates the dead private graph-pool handles, so the next executor warms up and captures against its own buffers.
(I read #16591's description of the fix and the post-fix ``Backend.clear_piecewise_cuda_graphs`` /
``PiecewiseRunner.clear_cuda_graphs`` code, not #15923's diff itself. Tiny model: two pieces around an eager
attention boundary, one captured token count; embeddings as one-hot GEMMs; outputs kept by strong reference, not
the upstream weak reference.)
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from workbench.engine import events, graph, graph_pool_handle, new_graph
from workbench.zoo.kit import compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/15923"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "_release_cuda_graphs"
SYMPTOM = "the final executor's warmup replays phase-1 piecewise graphs that read the torn-down engine's freed inputs"

VOCAB, DIM, MAX_POS = 12, 4, 8
CAPTURE_NUM_TOKENS = [4]
MAX_NUM_TOKENS = max(CAPTURE_NUM_TOKENS)
WARMUP_STEPS = 3

_flags = {"piecewise": False, "capture_piecewise": False}


@contextmanager
def capture_piecewise_cuda_graph(enable: bool):
    old = _flags["capture_piecewise"]
    _flags["capture_piecewise"] = enable
    try:
        yield
    finally:
        _flags["capture_piecewise"] = old


@dataclasses.dataclass
class Entry:
    shape: int
    warmup_count: int = 0
    input_addresses: list | None = None
    output_addresses: list | None = None
    cuda_graph: object = None
    callable: object = None
    output: tuple | None = None


class PiecewiseRunner:
    def __init__(self, name, callable_, capture_num_tokens, graph_pool_handle, device):
        self.name, self.default_callable, self.device = name, callable_, device
        self.graph_pool_handle = graph_pool_handle
        self.entries = {n: Entry(n, callable=callable_) for n in capture_num_tokens}

    def clear_cuda_graphs(self):
        """Release captures while retaining buckets for a later warmup."""
        for entry in self.entries.values():
            if entry.cuda_graph is not None:
                entry.cuda_graph.reset()
            entry.cuda_graph = None
            entry.warmup_count = 0
            entry.input_addresses = None
            entry.output_addresses = None
            entry.output = None

    def __call__(self, *args):
        runtime_num_of_token = args[0].shape[0]
        if runtime_num_of_token not in self.entries or not _flags["piecewise"]:
            return self.default_callable(*args)
        entry = self.entries[runtime_num_of_token]
        if entry.cuda_graph is None:
            if not _flags["capture_piecewise"]:
                return entry.callable(*args)
            if entry.warmup_count < WARMUP_STEPS:
                entry.warmup_count += 1
                with events.warmup():
                    return entry.callable(*args)
            entry.input_addresses = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
            g = new_graph(self.device)
            with graph(g, pool=self.graph_pool_handle, name=f"{self.name} {runtime_num_of_token} tokens"):
                output = entry.callable(*args)
            entry.cuda_graph, entry.output = g, output
            entry.output_addresses = [o.data_ptr() for o in output]
            return replay(g, output)
        # Replay: the arguments are assumed to live where they lived at capture (checked in debug mode only).
        return replay(entry.cuda_graph, entry.output)


class Backend:
    """The torch.compile backend of the compiled model: it creates and tracks the piecewise runners."""

    def __init__(self, device):
        self.device = device
        self._graph_pool_handle = graph_pool_handle(device)
        self._piecewise_runners: list[PiecewiseRunner] = []

    def piecewise_optimizer(self, submods):
        runners = [PiecewiseRunner(name, fn, CAPTURE_NUM_TOKENS, self._graph_pool_handle, self.device)
                   for name, fn in submods]
        self._piecewise_runners += runners
        return runners

    def clear_piecewise_cuda_graphs(self) -> None:
        runners = list(self._piecewise_runners)
        for runner in runners:
            runner.clear_cuda_graphs()
        # A private pool handle cannot be reused after its last graph is reset: rotate dead handles, keeping sharing.
        replacement_pools = {}
        for runner in runners:
            old_pool = runner.graph_pool_handle
            if id(old_pool) not in replacement_pools:
                replacement_pools[id(old_pool)] = graph_pool_handle(self.device)
            runner.graph_pool_handle = replacement_pools[id(old_pool)]


class DecoderModel:
    """One decoder layer, compiled into two pieces around the attention boundary op."""

    def __init__(self, device, backend):
        gen = generator(15923)
        self.device, self.backend = device, backend
        self.embed = randn(VOCAB, DIM, gen=gen, device=device)
        self.pos_embed = randn(MAX_POS, DIM, gen=gen, device=device, scale=0.5)
        self.wq, self.wk, self.wo, self.lm_head = (randn(DIM, DIM, gen=gen, device=device, scale=0.7)
                                                   for _ in range(4))
        self.vocab_ids = torch.arange(VOCAB, device=device)
        self.pos_ids = torch.arange(MAX_POS, device=device)
        self.submod_0, self.submod_2 = backend.piecewise_optimizer([("submod_0", self._submod_0),
                                                                    ("submod_2", self._submod_2)])

    def _submod_0(self, input_ids, position_ids):
        h = ((input_ids[:, None] == self.vocab_ids).float() @ self.embed
             + (position_ids[:, None] == self.pos_ids).float() @ self.pos_embed)
        attn_output = torch.empty_like(h)          # written in place by the attention boundary op
        return h, h @ self.wq, h @ self.wk, attn_output

    def _submod_2(self, h, attn_output):
        return (attn_output @ self.wo + h) @ self.lm_head

    def forward(self, input_ids, position_ids, attn_metadata):
        h, q, k, attn_output = self.submod_0(input_ids, position_ids)
        attn_custom_op_inplace(q, k, attn_output, attn_metadata)
        return self.submod_2(h, attn_output)


def attn_custom_op_inplace(q, k, output, attn_metadata):
    """Eager boundary op: write this context's keys to the KV cache, causal attention over them (values = keys)."""
    kv_cache, slots = attn_metadata.kv_cache, attn_metadata.slots
    kv_cache[slots] = k
    keys = kv_cache[slots]
    n = keys.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax((q @ keys.T).masked_fill(~mask, -1e9), -1)
    output.copy_(p @ keys)


@dataclasses.dataclass
class AttentionMetadata:
    kv_cache: torch.Tensor
    slots: torch.Tensor


class KVCacheManager:
    def __init__(self, num_slots, device):
        self.kv_cache = torch.zeros(num_slots, DIM, device=device)


class PyTorchModelEngine:
    def __init__(self, model, kv_cache_manager, device, variant):
        self.model, self.kv_cache_manager, self.device, self.variant = model, kv_cache_manager, device, variant
        self.input_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        self.position_ids_cuda = torch.zeros(MAX_NUM_TOKENS, dtype=torch.long, device=device)
        events.static_buffers("PyTorchModelEngine", {"input_ids_cuda": self.input_ids_cuda,
                                                     "position_ids_cuda": self.position_ids_cuda})
        events.persistent_state("KVCacheManager", {"kv_cache": kv_cache_manager.kv_cache})

    def forward(self, token_ids, start_slot=0):
        n = len(token_ids)
        self.input_ids_cuda[:n].copy_(torch.tensor(token_ids, device=self.device))
        self.position_ids_cuda[:n].copy_(torch.arange(n, device=self.device))
        slots = torch.arange(start_slot, start_slot + n, device=self.device)
        metadata = AttentionMetadata(self.kv_cache_manager.kv_cache, slots)
        return self.model.forward(self.input_ids_cuda[:n], self.position_ids_cuda[:n], metadata)[-1].clone()

    def warmup(self):
        with capture_piecewise_cuda_graph(True):
            for num_tokens in CAPTURE_NUM_TOKENS:
                for _ in range(WARMUP_STEPS + 1):
                    self.forward([0] * num_tokens)

    def _release_cuda_graphs(self):
        # The regular CUDAGraphRunner (decode) graphs are released here (this tiny engine has none).
        if self.variant == "fix":
            self.model.backend.clear_piecewise_cuda_graphs()

    def shutdown(self):
        self._release_cuda_graphs()


def run(variant: str, device: str = "cpu"):
    requests = [[3, 5, 7, 9], [2, 4, 6, 8], [1, 10, 11, 3]]

    def serve(piecewise: bool):
        _flags["piecewise"] = piecewise
        try:
            backend = Backend(device)
            model = DecoderModel(device, backend)
            # Phase 1: the KV-cache-estimation executor warms up (captures) and profiles, then is torn down.
            estimation_kv = KVCacheManager(2 * MAX_NUM_TOKENS, device)
            engine = PyTorchModelEngine(model, estimation_kv, device, variant)
            engine.warmup()
            outs = [engine.forward([4, 4, 4, 4])]
            engine.shutdown()
            del engine, estimation_kv
            # Phase 2: final KV cache, then a new engine on the same compiled model warms up and serves.
            final_kv = KVCacheManager(8 * MAX_NUM_TOKENS, device)
            engine = PyTorchModelEngine(model, final_kv, device, variant)
            engine.warmup()
            outs += [engine.forward(r, start_slot=MAX_NUM_TOKENS * (i + 1)) for i, r in enumerate(requests)]
            return outs
        finally:
            _flags["piecewise"] = False

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
