"""Growing the hybrid recurrent-state pool frees the old state tensors; slot-keyed decode graphs keep replaying on them.

Upstream: https://github.com/EricLBuehler/mistral.rs/pull/2377 ("fix(qwen3.8): fixes around gdn rollback for
qwen3.8", commit 326f1d612d7bf9ba58b05b1d34d0d89d312e49c8, 2026-08-18). No issue linked; the fix's own comment:
"Captured decode graphs hold the old pool buffers; growth reallocates them". (Perf PR #2390 repeats it:
"Reserving graph capacity may reallocate the pools, invalidating every captured graph".)
Symptom: hybrid GDN/Mamba models (Qwen3-Next, Qwen3.5, Qwen3.8) with CUDA decode graphs: once concurrency rises
past the pool's first capacity (``INITIAL_POOL_CAPACITY`` = 4), decode batches whose slot set was captured earlier
go silently wrong (state frozen at the growth, or garbage once the freed memory is handed on), or hit an
illegal memory access. Eager decode is correct.
Mechanism: ``Engine::add_request`` (mistralrs-core/src/engine/add_request.rs) calls ``HybridCache::allocate_seq``
-> ``RecurrentStatePool::allocate``, which calls ``grow()`` (kv_cache/hybrid_cache.rs) when no slot is free:
``Tensor::zeros`` of twice the capacity, ``slice_set`` of the old ``conv_state`` / ``recurrent_state`` into them,
and the fields replaced -- the old tensors are dropped and their device memory freed (candle keeps no tensor
alive for a graph). ``NormalPipeline::try_cuda_decode_graph_forward`` (pipeline/normal.rs) looks a graph up by
``CudaDecodeGraphKey`` (input shape, ...) ``.with_state_key(state_indices_host)``: batch and slot indices, not
the pool storage. The captured decode's ``gather_conv_state`` / ``gather_recurrent_state`` (``index_select``) and
``scatter_*_with_host_indices`` (``slice_set`` at baked slot offsets) hold the capture-time pool addresses;
``CudaDecodeGraphEntry`` retains only the state-index tensors. When a later decode batch has a slot set seen
before the growth (here: E, which forced the growth, has finished), ``CudaDecodeGraphState::replay`` launches
the old graph: it reads and writes the freed pool, and the live states in the new pool never advance. Eager
decode reads ``pool.conv_state`` / ``pool.recurrent_state`` afresh each step.
Doctor: dangling-reference, at add_request (the slot allocation it makes grows the pool, which releases the
``conv_state`` / ``recurrent_state`` storage the captured decode graphs reference only by address, and it
leaves those graphs in ``cuda_decode_graph``, so a matching key replays them on the freed memory).
Fix (upstream): ``add_request`` compares ``hybrid_cache.recurrent_capacity()`` (new) before and after
``allocate_seq()`` and, if the pool grew, calls ``pipeline.cleanup_cuda_graphs()`` (clears every
``CudaDecodeGraphEntry``); the next decode captures against the new pool. (The PR's other changes -- GDN
rollback, ``reset_attention_and_slots``, sampler/tool parsing -- are not about graphs and are left out.)
Modelled: one GDN (gated delta rule) layer with a causal-conv state, no attention layers or paged KV cache;
prefill runs token by token, eagerly (prompt steps are never graphed); sampling left out (each step's token is
drawn in advance); the graph key is (input shape, slot indices). ``Tensor::zeros`` on CUDA gets a segment of
its own and the freed pool is handed back to the driver as candle frees a dropped ``CudaSlice``, so the stale
replay faults there (or, if the memory stayed mapped, reads the state frozen at the growth), as the CPU
emulation raises ``IllegalMemoryAccess``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, own_segment_elems, randn, release_to_driver, replay

UPSTREAM = "https://github.com/EricLBuehler/mistral.rs/pull/2377"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "add_request"
SYMPTOM = ("after a new request grows the recurrent-state pool, decode graphs keyed by the old slot set replay on "
           "the freed conv/recurrent state")

VOCAB, HIDDEN = 16, 8
N_V_HEADS, KEY_DIM, VALUE_DIM, CONV_WIDTH = 2, 4, 4, 4
CONV_DIM = 2 * N_V_HEADS * KEY_DIM + N_V_HEADS * VALUE_DIM
INITIAL_POOL_CAPACITY = 4                     # Initial pool capacity before dynamic growth.
CUDA_DECODE_GRAPH_CACHE_CAPACITY = 32
PROMPTS = {"A": 3, "B": 2, "C": 4, "D": 3, "E": 2}
E_DECODE_STEPS = 2                            # E's max_tokens: it finishes after two decode steps


def Tensor_zeros(shape, dtype, device):
    """``Tensor::zeros``: candle has no caching allocator, a dropped tensor's ``CudaSlice`` is freed. On CUDA
    the block gets a segment of its own (over 10 MiB: never split), so ``release_to_driver`` unmaps it once
    its owner drops it."""
    numel = math.prod(shape)
    if torch.device(device).type == "cuda":
        flat = torch.zeros(numel + 3 * own_segment_elems(device), dtype=dtype, device=device)
        return flat[:numel].view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


class RecurrentStatePool:
    """Pool-based recurrent state cache for continuous batching (``kv_cache/hybrid_cache.rs``)."""

    def __init__(self, conv_dim, conv_width, state_dims, device):
        self.capacity = INITIAL_POOL_CAPACITY
        self.conv_dim, self.conv_width, self.state_dims = conv_dim, conv_width, state_dims
        self.device = device
        self.conv_state = Tensor_zeros((self.capacity, conv_dim, conv_width), torch.float32, device)
        self.recurrent_state = Tensor_zeros((self.capacity, *state_dims), torch.float32, device)
        self.free_slots = list(reversed(range(self.capacity)))

    def grow(self):
        """Grow the pool by doubling capacity."""
        new_capacity = self.capacity * 2
        new_conv = Tensor_zeros((new_capacity, self.conv_dim, self.conv_width), torch.float32, self.device)
        new_conv[:self.capacity].copy_(self.conv_state)                 # new_conv.slice_set(&self.conv_state, 0, 0)
        new_recurrent = Tensor_zeros((new_capacity, *self.state_dims), torch.float32, self.device)
        new_recurrent[:self.capacity].copy_(self.recurrent_state)
        self.free_slots.extend(reversed(range(self.capacity, new_capacity)))
        self.conv_state = new_conv                                      # the old tensors are dropped: freed
        self.recurrent_state = new_recurrent
        self.capacity = new_capacity
        release_to_driver(self.device)                                  # candle frees a dropped CudaSlice

    def allocate(self):
        if not self.free_slots:
            self.grow()
        slot_idx = self.free_slots.pop()
        self.reset_slot(slot_idx)
        return slot_idx

    def free(self, slot_idx):
        self.free_slots.append(slot_idx)

    def gather_conv_state(self, state_indices):
        return self.conv_state.index_select(0, state_indices)

    def gather_recurrent_state(self, state_indices):
        return self.recurrent_state.index_select(0, state_indices)

    def scatter_conv_state_with_host_indices(self, state_indices, host_indices, values):
        for batch_idx, slot_idx in enumerate(host_indices):
            self.conv_state[slot_idx:slot_idx + 1].copy_(values[batch_idx:batch_idx + 1])

    def scatter_recurrent_state_with_host_indices(self, state_indices, host_indices, values):
        for batch_idx, slot_idx in enumerate(host_indices):
            self.recurrent_state[slot_idx:slot_idx + 1].copy_(values[batch_idx:batch_idx + 1])

    def reset_slot(self, slot_idx):
        self.conv_state[slot_idx:slot_idx + 1].zero_()
        self.recurrent_state[slot_idx:slot_idx + 1].zero_()


class HybridCache:
    def __init__(self, device):
        self.caches = [RecurrentStatePool(CONV_DIM, CONV_WIDTH, (N_V_HEADS, KEY_DIM, VALUE_DIM), device)]
        self.state_indices = self.state_indices_host_ = None

    def recurrent_capacity(self):
        """Slot capacity of the recurrent pools; changes whenever the pool storage is reallocated (#2377)."""
        return self.caches[0].capacity

    def allocate_seq(self):
        slots = {pool.allocate() for pool in self.caches}
        assert len(slots) == 1
        return slots.pop()

    def free_seq(self, slot_idx):
        for pool in self.caches:
            pool.free(slot_idx)

    def set_state_indices_with_host(self, indices, host_indices):
        self.state_indices, self.state_indices_host_ = indices, host_indices

    def state_indices_host(self):
        return self.state_indices_host_

    def state_index_tensors(self):
        return [self.state_indices]

    def state_indices_for_layer(self, layer):
        return self.state_indices

    def get_mut(self, layer):
        return self.caches[layer]


class GdnLayerCache:
    def __init__(self, conv_state, recurrent_state):
        self.conv_state, self.recurrent_state = conv_state, recurrent_state


class GatedDeltaNet:
    """The linear-attention layer, decode (one token a row): causal conv update, then the gated delta rule."""

    def __init__(self, gen, device):
        self.in_proj_qkv = randn(HIDDEN, CONV_DIM, gen=gen, device=device, scale=0.5)
        self.conv1d_weight = randn(CONV_DIM, CONV_WIDTH, gen=gen, device=device, scale=0.5)
        self.in_proj_b = randn(HIDDEN, N_V_HEADS, gen=gen, device=device)
        self.in_proj_a = randn(HIDDEN, N_V_HEADS, gen=gen, device=device)
        self.out_proj = randn(N_V_HEADS * VALUE_DIM, HIDDEN, gen=gen, device=device, scale=0.5)

    def forward_linear(self, xs, cache):
        b = xs.shape[0]
        mixed = xs @ self.in_proj_qkv
        window = torch.cat([cache.conv_state[:, :, 1:], mixed[:, :, None]], dim=-1)      # causal_conv1d_update
        cache.conv_state = window
        conv = F.silu((window * self.conv1d_weight).sum(-1))
        q, k, v = conv.split([N_V_HEADS * KEY_DIM, N_V_HEADS * KEY_DIM, N_V_HEADS * VALUE_DIM], dim=-1)
        q = F.normalize(q.view(b, N_V_HEADS, KEY_DIM), dim=-1)
        k = F.normalize(k.view(b, N_V_HEADS, KEY_DIM), dim=-1)
        v = v.view(b, N_V_HEADS, VALUE_DIM)
        beta = torch.sigmoid(xs @ self.in_proj_b)
        g = torch.exp(-F.softplus(xs @ self.in_proj_a))
        state = cache.recurrent_state * g[:, :, None, None]                            # gated_delta_rule_recurrence
        delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
        state = state + k[..., :, None] * delta[..., None, :]
        cache.recurrent_state = state
        return (state * q[..., None]).sum(-2).reshape(b, -1) @ self.out_proj


class Qwen3NextModel:
    def __init__(self, device):
        gen = generator(2377)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layer = GatedDeltaNet(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.cache = HybridCache(device)

    def forward(self, input_ids):
        xs = self.embed_tokens[input_ids[:, -1]]
        hybrid_cache = self.cache
        indices = hybrid_cache.state_indices_for_layer(0)
        pool = hybrid_cache.get_mut(0)
        gdn_cache = GdnLayerCache(pool.gather_conv_state(indices), pool.gather_recurrent_state(indices))
        xs = xs + self.layer.forward_linear(xs, gdn_cache)
        host = hybrid_cache.state_indices_host()
        pool.scatter_conv_state_with_host_indices(indices, host, gdn_cache.conv_state)
        pool.scatter_recurrent_state_with_host_indices(indices, host, gdn_cache.recurrent_state)
        return F.layer_norm(xs, (HIDDEN,)) @ self.lm_head


class CudaDecodeGraphKey:
    """Input shape (and, in upstream, the metadata tensors' shapes) plus the hybrid slot indices."""

    def __init__(self, input_shape, state_key=None):
        self.input_shape, self.state_key = input_shape, state_key

    @classmethod
    def new(cls, input_ids):
        return cls(tuple(input_ids.shape))

    def with_state_key(self, state_key):
        return CudaDecodeGraphKey(self.input_shape, None if state_key is None else tuple(state_key))

    def __eq__(self, other):
        return (self.input_shape, self.state_key) == (other.input_shape, other.state_key)


class CudaDecodeGraphEntry:
    def __init__(self, key, graph, input_ids, retained_tensors, logits):
        self.key, self.graph, self.logits = key, graph, logits
        self.input_ids = input_ids                      # Var: the static decode input
        self._retained_tensors = retained_tensors       # the state-index tensors (not the pools)


class CudaDecodeGraphState:
    def __init__(self):
        self.entries = []

    def clear(self):
        self.entries.clear()

    def replay(self, key, input_ids):
        pos = next((i for i, e in enumerate(self.entries) if e.key == key), None)
        if pos is None:
            return None
        entry = self.entries.pop(pos)
        entry.input_ids.copy_(input_ids)                                # entry.input_ids.set(input_ids)
        logits = replay(entry.graph, entry.logits)                      # entry.graph.launch()
        self.entries.append(entry)
        return logits

    def insert(self, entry):
        if len(self.entries) >= CUDA_DECODE_GRAPH_CACHE_CAPACITY:
            self.entries.pop(0)
        self.entries.append(entry)


def capture_cuda_decode_graph(key, input_ids, warmup_logits, retained_tensors, forward, pool, device):
    graph_input_ids = input_ids.clone()                                 # Var::from_tensor(input_ids)
    graph_logits = torch.empty_like(warmup_logits)

    def captured():
        graph_logits.copy_(forward(graph_input_ids))                    # copy_tensor(&logits, &graph_logits)
        return graph_logits

    graph, _ = capture(captured, device=device, warmups=0, name=f"decode bs {key.input_shape[0]} slots {key.state_key}",
                       owner="CudaDecodeGraphState", static={"input_ids": graph_input_ids},
                       state={"conv_state": pool.conv_state, "recurrent_state": pool.recurrent_state})
    return CudaDecodeGraphEntry(key, graph, graph_input_ids, retained_tensors, graph_logits)


class NormalPipeline:
    def __init__(self, model, device, cuda_graphs):
        self.model, self.device, self.cuda_graphs = model, device, cuda_graphs
        self.cuda_decode_graph = CudaDecodeGraphState()

    def cache(self):
        return self.model.cache

    def cleanup_cuda_graphs(self):
        self.cuda_decode_graph.clear()

    def forward_inputs(self, input_ids, is_prompt):
        if self.cuda_graphs and not is_prompt:
            logits = self.try_cuda_decode_graph_forward(input_ids)
            if logits is not None:
                return logits
        return self.model.forward(input_ids)

    def try_cuda_decode_graph_forward(self, input_ids):
        hybrid_state_key = self.model.cache.state_indices_host()
        key = CudaDecodeGraphKey.new(input_ids).with_state_key(hybrid_state_key)
        logits = self.cuda_decode_graph.replay(key, input_ids)
        if logits is not None:
            return logits
        with events.warmup():
            warmup_logits = self.model.forward(input_ids)
        retained_tensors = self.model.cache.state_index_tensors()
        entry = capture_cuda_decode_graph(key, input_ids, warmup_logits, retained_tensors, self.model.forward,
                                          self.model.cache.get_mut(0), self.device)
        self.cuda_decode_graph.insert(entry)
        return warmup_logits


class Sequence:
    def __init__(self, name, prompt):
        self.name, self.prompt, self.recurrent_state_idx = name, prompt, None


class Engine:
    def __init__(self, device, variant, cuda_graphs):
        self.device, self.variant = device, variant
        self.pipeline = NormalPipeline(Qwen3NextModel(device), device, cuda_graphs)

    def add_request(self, seq):
        pipeline = self.pipeline
        hybrid_cache = pipeline.cache()
        if self.variant == "fix":
            capacity_before = hybrid_cache.recurrent_capacity()
            slot = hybrid_cache.allocate_seq()
            # Captured decode graphs hold the old pool buffers; growth reallocates them
            pool_grew = hybrid_cache.recurrent_capacity() != capacity_before
            if pool_grew:
                pipeline.cleanup_cuda_graphs()
        else:
            slot = hybrid_cache.allocate_seq()
        seq.recurrent_state_idx = slot

    def clone_in_cache(self, seqs):
        indices = [s.recurrent_state_idx for s in seqs]
        self.pipeline.cache().set_state_indices_with_host(
            torch.tensor(indices, dtype=torch.long).to(self.device), indices)

    def step(self, seqs, tokens, is_prompt):
        self.clone_in_cache(seqs)
        logits = self.pipeline.forward_inputs(tokens[:, None].to(self.device), is_prompt)
        return logits.clone()                                           # sampled before the next step

    def prefill(self, seq):
        out = None
        for tok in seq.prompt:                                          # prompt steps: never graphed
            out = self.step([seq], tok.reshape(1), is_prompt=True)
        return out

    def free_finished(self, seq):
        self.pipeline.cache().free_seq(seq.recurrent_state_idx)


def run(variant: str, device: str = "cpu"):
    gen = generator(23770)
    prompts = {n: torch.randint(0, VOCAB, (length,), generator=gen) for n, length in PROMPTS.items()}
    decode_tokens = torch.randint(0, VOCAB, (16, len(PROMPTS)), generator=gen)

    def serve(graphed: bool):
        engine, outs, t = Engine(device, variant, graphed), [], 0
        seqs = {n: Sequence(n, p) for n, p in prompts.items()}
        names = list(PROMPTS)

        def decode(batch):
            nonlocal t
            tokens = decode_tokens[t, [names.index(s.name) for s in batch]]
            t += 1
            outs.append(engine.step(batch, tokens, is_prompt=False))

        first = [seqs[n] for n in "ABCD"]                               # fills the pool's 4 slots
        for s in first:
            engine.add_request(s)
            outs.append(engine.prefill(s))
        for _ in range(3):
            decode(first)                                               # graph for slots (0, 1, 2, 3)
        engine.add_request(seqs["E"])                                   # no free slot: the pool grows to 8
        outs.append(engine.prefill(seqs["E"]))
        for _ in range(E_DECODE_STEPS):
            decode(first + [seqs["E"]])                                 # graph for slots (0, 1, 2, 3, 4)
        engine.free_finished(seqs["E"])
        for _ in range(3):
            decode(first)                                               # slots (0, 1, 2, 3) again
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
