"""M* (mstar) CUDA graph runner, Higgs Audio prefill: a graph captured under one graph walk is also registered under the
config's other replay walks, but the slot lease for an aliased walk names the alias bucket, so the resources that key
their per-slot state on ``lease.bucket`` (position ids, attention wrappers) plan into fresh buffers the graph never
reads; the replay reads the capture walk's buffers, which still hold an earlier step's positions and lengths.

Upstream: https://github.com/mstar-project/mstar/commit/c631de4adf7abf2f63857d7c52cc2a6285aa38a9 ("Migrate orpheus and
higgs; fix slot aliasing bug", mstar-project/mstar, by NSagan271, authored and committed 2026-08-20, on the engine-v1
branch ``resource_pools_2``; a commit, no pull request).
Read: the commit's diff of ``mstar/engine/v1/cuda_graph_runner.py`` (``CudaGraphRunner.lease_slot`` now returns
``SlotLease(bucket=replace(key, graph_walk=bucket.config.capture_graph_walk))``, with the comment "Resources key their
per-slot state (attention wrappers, position buffers) on ``lease.bucket``, so a lease naming an aliased walk would build
them fresh at replay instead of reusing the ones the graph recorded addresses for") and of ``attention_manager.py``
(cross-attention padding rows planned against ``SINK_PAGE``; not modelled). At the parent commit: ``CudaGraphRunner``
(``__init__``, ``_get_slot_specs``, ``_get_addtl_slot_specs`` "the same capture, keyed under the config's other replay
walks", ``warmup_and_capture``, ``_register_slot``, ``_capture_one``, ``lease_slot``, ``slot_for``, ``_stage``,
``_replay``, ``run_forward``), ``PositionManager`` (``_static_buffer`` keyed by ``CGSlotKey(bucket, slot, label)``,
``plan``, ``_place``, ``apply_qk``), ``FlashInferAttentionManager`` (``_cg_wrapper`` keyed by ``CGSlotKey``,
``_eager_wrapper``, ``plan``), ``KVCacheManager._setup_plan_states`` (static plan state keyed by ``(slot, label)``
only) and, at the commit, Higgs Audio's ``get_cuda_graph_configs`` (prefill captured as ``"prefill_text"``, replayed for
``["prefill_text", "prefill_audio"]``).
Symptom: ``prefill_audio`` steps replay the ``prefill_text`` graph with the positions and attention plan of an earlier
step (or of the capture's dummy rows): wrong attention and wrongly rotated keys in the KV cache; eager is correct.
Mechanism: capture runs under the capture walk, so the graph recorded the position buffer and attention wrapper of
``CGSlotKey(bucket=<capture walk bucket>, slot, label)``. ``lease_slot`` for ``prefill_audio`` finds the bucket through
its alias key and returns a lease naming the alias; ``_place`` and ``_cg_wrapper`` build fresh buffers under that key
and the step's plan goes there. ``_stage`` and the slot-keyed KV plan state still reach the graph's buffers, so the
replay sees this step's embeddings and cache slots with a stale position vector and attention plan.
Doctor: stale-input, at lease_slot. The graph's static position ids and attention plan are never written by an aliased
step; the replay reads what the last step planned under the capture walk. The lease that names the alias bucket is
where upstream fixed it.
Fix (upstream): hand back the bucket the capture ran under: ``bucket=replace(key, graph_walk=capture_graph_walk)``.
Modelled: as read: the keys, the capture of every (bucket, slot) under the capture walk and its registration under
every replay walk, the global double-buffer slot rotation, interned per-config static inputs (one max-bucket buffer
sliced per bucket), ``_stage`` / ``_replay``, the per-``CGSlotKey`` position buffers and attention wrappers, the
slot-keyed KV plan state, a ``StepRunner`` planning KV, positions, attention in that order, dummy rows reset after
capture (two warm-ups, no re-plan between them). Stand-ins:
one prefill config whose buckets are exact ``(bs, 3 * bs)`` token counts (no padding rows; Higgs uses packed token
buckets), a one-layer single-head LLM (embedding tables for text and audio tokens in place of the text embedding and
the audio tower, RoPE from the position manager, KV writes, attention over each row's cache up to the planned KV
length), a stand-in wrapper for FlashInfer's CUDA-graph prefill wrapper (its plan copies the KV lengths and cache rows
into buffers it owns); no decode walk, no pre-planning, no sampler; float64.
Workload: prompts A and B; prefill_text [A, B] (bucket (2, 6), slot 0), prefill_audio [A, B] (slot 1), prefill_audio
[A] (bucket (1, 3)), prefill_text [A, B], prefill_audio [B]; 3 tokens per request per step; logits of every step
compared with eager. Bug: max |graph - eager| = 7.65, from the first audio step on (it replays with the positions 0..2
and KV lengths 1..3 the capture's dummy rows left in slot 1's buffers; later steps also attend to keys rotated at wrong
positions); per step 0, 7.65, 1.56, 3.43, 7.36. Fix: equal to eager (max error 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace

import torch

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/mstar-project/mstar/commit/c631de4adf7abf2f63857d7c52cc2a6285aa38a9"
FAMILY = "warmup/capture vs replay state"
KIND = "stale-input"
SITE = "lease_slot"
SYMPTOM = ("A prefill on an aliased graph walk replays the captured graph while its position ids and attention plan go "
           "into fresh buffers keyed on the alias bucket; the graph reads an earlier step's positions and lengths")

HIDDEN, HEAD_DIM, TEXT_VOCAB, AUDIO_VOCAB = 8, 8, 24, 16
MAX_LEN, MAX_ROWS, CHUNK = 16, 8, 3
PREFILL_CAPTURE_BATCH_SIZES = [1, 2]
LABEL = "llm"
DTYPE = torch.float64

_variant = "bug"

# --- mstar/engine/resources/step.py, base.py --------------------------------------------------------------------------

BucketKey = make_dataclass("BucketKey", ["graph_walk", "cg_key_info", "bs", "num_tokens"], frozen=True)
SlotLease = make_dataclass("SlotLease", ["slot", "bucket"], frozen=True)
CGSlotKey = make_dataclass("CGSlotKey", ["bucket", "slot", "label"], frozen=True)
CGSlotSpec = make_dataclass("CGSlotSpec", ["bucket", "slot", "config", "config_idx"], frozen=True)
SequenceView = make_dataclass("SequenceView", ["request_id", "row", "start", "to_compute"])

@dataclass
class StepContext:
    slot_lease: SlotLease | None = None
    plan_results: dict = field(default_factory=dict)

class CudaGraphConfig:
    def __init__(self, capture_graph_walk, replay_graph_walks=None, capture_batch_sizes=None):
        self.capture_graph_walk = capture_graph_walk
        self.replay_graph_walks = replay_graph_walks or [capture_graph_walk]
        self.capture_batch_sizes = capture_batch_sizes
        self.additional_key_info = None

    def get_total_tokens(self, bs):
        return [bs * CHUNK]

    def get_node_inputs(self, bs, num_tokens):
        return [[0] * (num_tokens // bs) for _ in range(bs)]

# --- resources: KV cache, positions, attention (mstar/engine/v1/*_manager.py) -----------------------------------------

class KVCacheManager:
    def __init__(self, device):
        self.device = device
        self.k_cache = torch.zeros(MAX_ROWS * MAX_LEN, HEAD_DIM, dtype=DTYPE, device=device)
        self.v_cache = torch.zeros(MAX_ROWS * MAX_LEN, HEAD_DIM, dtype=DTYPE, device=device)
        self._rows, self._lengths = {}, {}
        self._static_plan_states = {}            # (slot, label) -> token_to_cache, sized for the largest bucket
        self._current_plan_states = {}

    def ingest_request(self, rid):
        self._rows[rid], self._lengths[rid] = len(self._rows), 0

    def reset(self, rids):
        self._lengths.update(dict.fromkeys(rids, 0))

    def _static_plan_state(self, slot, label):
        return self._static_plan_states.setdefault(
            (slot, label), torch.zeros(MAX_ROWS * CHUNK, dtype=torch.long, device=self.device))

    def plan(self, segments, ctx: StepContext):
        views, token_to_cache = [], []
        for rid, n in segments:
            start, row = self._lengths[rid], self._rows[rid]
            views.append(SequenceView(rid, row, start, n))
            token_to_cache += [row * MAX_LEN + start + i for i in range(n)]
        plan_state = torch.tensor(token_to_cache, dtype=torch.long).to(self.device)
        if ctx.slot_lease is not None:                           # keyed by slot only, not by bucket
            static_state = self._static_plan_state(ctx.slot_lease.slot, LABEL)
            static_state[: plan_state.shape[0]].copy_(plan_state)
            plan_state = static_state[: ctx.slot_lease.bucket.num_tokens]
        self._current_plan_states[LABEL] = plan_state
        ctx.plan_results["kv"] = {LABEL: views}

    def write(self, k, v, label):
        self.k_cache.index_copy_(0, self._current_plan_states[label], k)
        self.v_cache.index_copy_(0, self._current_plan_states[label], v)

    def commit(self, segments):
        self._lengths.update({rid: self._lengths[rid] + n for rid, n in segments})

class PositionManager:
    def __init__(self, device):
        self.device = device
        self._static_pos_ids, self._current_pos_ids, self._counters = {}, {}, {}
        self._inv_freq = (1.0 / (100.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=DTYPE) / HEAD_DIM))).to(device)

    def ingest_request(self, rid):
        self._counters[rid] = 0

    def reset(self, rids):
        self._counters.update(dict.fromkeys(rids, 0))

    def _static_buffer(self, key: CGSlotKey, num_tokens):
        """The captured-graph pos_ids buffer for one (bucket, slot, label), built on the first plan for that key."""
        buffer = self._static_pos_ids.get(key)
        if buffer is None:
            buffer = self._static_pos_ids[key] = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        return buffer

    def plan(self, ctx: StepContext):
        for plan_label, views in ctx.plan_results["kv"].items():
            pos_ids = torch.tensor([p for v in views for p in range(self._counters[v.request_id],
                                                                      self._counters[v.request_id] + v.to_compute)])
            self._current_pos_ids[plan_label] = self._place(pos_ids, plan_label, ctx)

    def _place(self, pos_ids, plan_label, ctx: StepContext):
        if ctx.slot_lease is None:
            return pos_ids.to(self.device)
        key = CGSlotKey(bucket=ctx.slot_lease.bucket, slot=ctx.slot_lease.slot, label=plan_label)
        buffer = self._static_buffer(key, ctx.slot_lease.bucket.num_tokens)
        buffer[: pos_ids.shape[0]].copy_(pos_ids)
        return buffer

    def commit(self, segments):
        self._counters.update({rid: self._counters[rid] + n for rid, n in segments})

    def apply_qk(self, q, k, label):
        angles = self._current_pos_ids[label].to(DTYPE)[:, None] * self._inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()

        def rotate(x):
            x1, x2 = x[:, 0::2], x[:, 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(1)
        return rotate(q), rotate(k)

class PrefillWrapper:
    """Stand-in for FlashInferPrefillWrapper: with ``use_cuda_graph`` its plan writes into buffers it owns."""

    def __init__(self, device, use_cuda_graph=False, max_total_tokens=0):
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            self.kv_len = torch.zeros(max_total_tokens, dtype=torch.long, device=device)
            self.rows = torch.zeros(max_total_tokens, dtype=torch.long, device=device)

    def plan(self, kv_len, rows):
        if self.use_cuda_graph:
            self.kv_len[: kv_len.shape[0]].copy_(kv_len)
            self.rows[: rows.shape[0]].copy_(rows)
        else:
            self.kv_len, self.rows = kv_len, rows

    def run(self, q, k_cache, v_cache):
        ctx = torch.arange(MAX_LEN, device=q.device)
        slots = self.rows[:, None] * MAX_LEN + ctx[None, :]
        scores = torch.einsum("td,tld->tl", q, k_cache[slots]) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(ctx[None, :] >= self.kv_len[:, None], float("-inf"))
        return torch.einsum("tl,tld->td", scores.softmax(-1), v_cache[slots])

class FlashInferAttentionManager:
    def __init__(self, device):
        self.device = device
        self._cg_plan_states, self._eager_plan_states, self._current_plan_states = {}, {}, {}

    def _cg_wrapper(self, lease: SlotLease, label):
        """The captured-graph wrapper for one (bucket, slot, label), built on the first plan for that key."""
        key = CGSlotKey(bucket=lease.bucket, slot=lease.slot, label=label)
        wrapper = self._cg_plan_states.get(key)
        if wrapper is None:
            wrapper = self._cg_plan_states[key] = PrefillWrapper(self.device, True, lease.bucket.num_tokens)
        return wrapper

    def _eager_wrapper(self, label):
        return self._eager_plan_states.setdefault(label, PrefillWrapper(self.device))

    def plan(self, ctx: StepContext):
        for label, views in ctx.plan_results["kv"].items():
            kv_len = torch.tensor([v.start + i + 1 for v in views for i in range(v.to_compute)]).to(self.device)
            rows = torch.tensor([v.row for v in views for _ in range(v.to_compute)]).to(self.device)
            lease = ctx.slot_lease
            wrapper = self._cg_wrapper(lease, label) if lease is not None else self._eager_wrapper(label)
            wrapper.plan(kv_len, rows)
            self._current_plan_states[label] = wrapper

    def run(self, q, label, kv: KVCacheManager):
        return self._current_plan_states[label].run(q, kv.k_cache, kv.v_cache)

class StepRunner:
    """Admits, plans and commits one step across the node's resources (KV first: the others plan from its views)."""

    def __init__(self, device):
        self.kv, self.positions = KVCacheManager(device), PositionManager(device)
        self.attention = FlashInferAttentionManager(device)

    def ingest_request(self, rid):
        self.kv.ingest_request(rid)
        self.positions.ingest_request(rid)

    def reset(self, rids):
        self.kv.reset(rids)
        self.positions.reset(rids)

    def plan(self, segments, ctx: StepContext):
        self.kv.plan(segments, ctx)
        self.positions.plan(ctx)
        self.attention.plan(ctx)

    def commit(self, segments):
        self.kv.commit(segments)
        self.positions.commit(segments)

# --- the model (stand-in for Higgs Audio's LLM prefill submodule) -----------------------------------------------------

class HiggsAudioLLM:
    def __init__(self, device, resources: StepRunner):
        gen = generator(631)
        r = lambda *s: randn(*s, gen=gen, device=device, scale=0.6).to(DTYPE)   # noqa: E731
        self.text_embed, self.audio_embed = r(TEXT_VOCAB, HIDDEN), r(AUDIO_VOCAB, HIDDEN)
        self.wq, self.wk, self.wv = r(HIDDEN, HEAD_DIM), r(HIDDEN, HEAD_DIM), r(HIDDEN, HEAD_DIM)
        self.wo = r(HEAD_DIM, HIDDEN)
        self.lm_head = r(HIDDEN, TEXT_VOCAB)
        self.device, self.res = device, resources

    def get_cuda_graph_configs(self):
        return [CudaGraphConfig(capture_graph_walk="prefill_text", replay_graph_walks=["prefill_text", "prefill_audio"],
                                capture_batch_sizes=PREFILL_CAPTURE_BATCH_SIZES)]

    def preprocess(self, graph_walk, inputs):
        table = self.text_embed if graph_walk == "prefill_text" else self.audio_embed
        ids = torch.tensor([t for tokens in inputs for t in tokens], dtype=torch.long).to(self.device)
        return {"input_embeds": table[ids]}

    def forward(self, graph_walk, input_embeds):
        h = input_embeds
        q, k = self.res.positions.apply_qk(h @ self.wq, h @ self.wk, LABEL)
        self.res.kv.write(k, h @ self.wv, LABEL)
        h = h + self.res.attention.run(q, LABEL, self.res.kv) @ self.wo
        return torch.nn.functional.rms_norm(h, (HIDDEN,)) @ self.lm_head

# --- mstar/engine/v1/cuda_graph_runner.py (reduced) -------------------------------------------------------------------

CudaGraphSlot = make_dataclass("CudaGraphSlot", ["graph", "static_inputs", "static_outputs"])

@dataclass
class CudaGraphBucket:
    config: CudaGraphConfig
    config_idx: int
    slots: list = field(default_factory=list)

class CudaGraphRunner:
    NUM_SLOTS, NUM_WARMUP = 2, 2

    def __init__(self, submodule: HiggsAudioLLM, resources: StepRunner, device):
        self._submodule, self._resources, self._device = submodule, resources, device
        self._capture_configs = submodule.get_cuda_graph_configs()
        self._num_slots = self.NUM_SLOTS
        self._buckets: dict[BucketKey, CudaGraphBucket] = {}
        self._next_slot = 0
        self._shared_static_buffers = {}
        self._dummy_rids = {}

    def _get_slot_specs(self):
        specs = []
        for config_idx, config in enumerate(self._capture_configs):
            for bs in config.capture_batch_sizes:
                for num_tokens in config.get_total_tokens(bs):
                    bucket = BucketKey(config.capture_graph_walk, config.additional_key_info, bs, num_tokens)
                    specs += [CGSlotSpec(bucket, slot, config, config_idx) for slot in range(self._num_slots)]
        return specs

    def _get_addtl_slot_specs(self, spec: CGSlotSpec):
        """The same capture, keyed under the config's other replay walks."""
        return [replace(spec, bucket=replace(spec.bucket, graph_walk=walk))
                for walk in spec.config.replay_graph_walks if walk != spec.config.capture_graph_walk]

    def _ensure_dummy_rows(self, key, bs):
        rids = self._dummy_rids.setdefault(key, [])
        while len(rids) < bs:
            rids.append(f"__dummy_{key}_{len(rids)}")
            self._resources.ingest_request(rids[-1])
        return rids[:bs]

    def warmup_and_capture(self):
        self._memory_pool = graph_pool_handle(self._device)
        slot_specs = sorted(self._get_slot_specs(), key=lambda s: (s.bucket.bs, s.bucket.num_tokens), reverse=True)
        for spec in slot_specs:
            slot = self._capture_one(spec)
            for key_spec in [spec, *self._get_addtl_slot_specs(spec)]:
                self._register_slot(key_spec, slot)

    def _register_slot(self, spec: CGSlotSpec, slot: CudaGraphSlot):
        bucket = self._buckets.get(spec.bucket)
        if bucket is None:
            bucket = self._buckets[spec.bucket] = CudaGraphBucket(spec.config, spec.config_idx)
        bucket.slots.append(slot)

    def _intern_static_buffer(self, config_idx, key, value):
        buf = self._shared_static_buffers.get((config_idx, key))
        if buf is None:                                          # captures run largest-first
            buf = self._shared_static_buffers[(config_idx, key)] = value.clone()
        buf[: value.shape[0]].copy_(value)
        return buf[: value.shape[0]]

    def _capture_one(self, spec: CGSlotSpec):
        walk, config, res = spec.bucket.graph_walk, spec.config, self._resources
        dummy_rids = self._ensure_dummy_rows(f"{spec.config_idx}_slot{spec.slot}", spec.bucket.bs)
        dummy_inputs = config.get_node_inputs(spec.bucket.bs, spec.bucket.num_tokens)
        ctx = StepContext(SlotLease(slot=spec.slot, bucket=spec.bucket))          # capture=True
        segments = [(rid, len(tokens)) for rid, tokens in zip(dummy_rids, dummy_inputs)]
        res.plan(segments, ctx)
        static_inputs = {key: self._intern_static_buffer(spec.config_idx, key, value)
                         for key, value in self._submodule.preprocess(walk, dummy_inputs).items()}

        def run_forward():
            return self._submodule.forward(walk, **static_inputs)

        wrapper = res.attention._current_plan_states[LABEL]
        static = {**static_inputs, "pos_ids": res.positions._current_pos_ids[LABEL], "kv_len": wrapper.kv_len,
                  "rows": wrapper.rows, "token_to_cache": res.kv._current_plan_states[LABEL]}
        graph, output = capture(run_forward, device=self._device, pool=self._memory_pool, warmups=self.NUM_WARMUP,
                                static=static, state={"k_cache": res.kv.k_cache, "v_cache": res.kv.v_cache},
                                owner="CudaGraphRunner", name=f"{spec.bucket} slot={spec.slot}")
        res.reset(dummy_rids)          # back to a clean stream state
        return CudaGraphSlot(graph, static_inputs, output)

    def select_bucket(self, graph_walk, bs, num_tokens):
        fits = [key for key in self._buckets if key.graph_walk == graph_walk and key.bs >= bs
                and key.num_tokens >= num_tokens]
        return min(fits, key=lambda key: (key.bs, key.num_tokens), default=None)

    def lease_slot(self, graph_walk, bs, num_tokens):
        """Pick the bucket and double-buffer slot an upcoming step replays on."""
        key = self.select_bucket(graph_walk, bs, num_tokens)
        if key is None:
            return None
        bucket = self._buckets[key]
        slot = self._next_slot
        self._next_slot = (self._next_slot + 1) % self._num_slots
        if _variant == "bug":
            return SlotLease(slot=slot % len(bucket.slots), bucket=key)
        # Hand back the bucket the capture ran under, not the alias this walk found it by.
        capture_key = replace(key, graph_walk=bucket.config.capture_graph_walk)
        return SlotLease(slot=slot % len(bucket.slots), bucket=capture_key)

    def slot_for(self, lease: SlotLease) -> CudaGraphSlot:
        return self._buckets[lease.bucket].slots[lease.slot]

    def _stage(self, lease: SlotLease, preprocessed):
        slot = self.slot_for(lease)
        for key, static_buf in slot.static_inputs.items():
            value = preprocessed[key]
            static_buf.narrow(0, 0, value.shape[0]).copy_(value)

    def run_forward(self, lease: SlotLease, preprocessed, real_tokens):
        self._stage(lease, preprocessed)
        slot = self.slot_for(lease)
        return replay(slot.graph, slot.static_outputs, real=real_tokens, size=lease.bucket.num_tokens)

# --- mstar/engine/v1/engine.py (reduced: one prefill node, no pre-planning) -------------------------------------------

class Engine:
    def __init__(self, device, use_cuda_graph):
        self.res = StepRunner(device)
        self.model = HiggsAudioLLM(device, self.res)
        self.runner = None
        if use_cuda_graph:
            self.runner = CudaGraphRunner(self.model, self.res, device)
            self.runner.warmup_and_capture()

    def step(self, graph_walk, batch):
        """``batch``: list of (request id, token ids) for this prefill chunk."""
        inputs = [tokens for _, tokens in batch]
        segments = [(rid, len(tokens)) for rid, tokens in batch]
        num_tokens = sum(n for _, n in segments)
        lease = self.runner.lease_slot(graph_walk, len(batch), num_tokens) if self.runner else None
        self.res.plan(segments, StepContext(slot_lease=lease))
        preprocessed = self.model.preprocess(graph_walk, inputs)
        if lease is not None:
            logits = self.runner.run_forward(lease, preprocessed, num_tokens)[:num_tokens].clone()
        else:
            logits = self.model.forward(graph_walk, **preprocessed).clone()
        self.res.commit(segments)
        return logits

def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(8020)
    text = lambda: torch.randint(0, TEXT_VOCAB, (CHUNK,), generator=gen).tolist()    # noqa: E731
    audio = lambda: torch.randint(0, AUDIO_VOCAB, (CHUNK,), generator=gen).tolist()  # noqa: E731
    steps = [("prefill_text", [("A", text()), ("B", text())]), ("prefill_audio", [("A", audio()), ("B", audio())]),
             ("prefill_audio", [("A", audio())]), ("prefill_text", [("A", text()), ("B", text())]),
             ("prefill_audio", [("B", audio())])]

    def serve(use_cuda_graph):
        engine = Engine(device, use_cuda_graph)
        engine.res.ingest_request("A")
        engine.res.ingest_request("B")
        return [engine.step(walk, batch) for walk, batch in steps]

    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
