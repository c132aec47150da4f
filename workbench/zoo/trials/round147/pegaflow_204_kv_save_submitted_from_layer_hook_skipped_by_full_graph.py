"""PegaFlow (novitalabs/pegaflow, a KV-cache offload store with a vLLM V1 KV connector, ``PegaKVConnector``) submitted
its KV saves from the connector's per-layer hook ``save_kv_layer``, which vLLM calls from the
``maybe_transfer_kv_layer`` wrapper of the attention op, inside the model forward. With vLLM's default
``FULL_AND_PIECEWISE`` graphs a uniform decode batch replays a FULL graph that captured the attention op too: the
hook ran only while the graph was captured (a dummy run with no connector metadata bound, so it returned at once) and
never runs on a replay. ``WorkerConnector.wait_for_save`` (eager, after the forward) then found the step's save
intents with no save task queued, logged them as "skipped saves (CUDA graph)" and marked them complete. Every block a
request filled while decoding was therefore never written to the PegaFlow store; only the blocks filled by prefill
steps (mixed batches, whose attention runs eagerly between PIECEWISE pieces) were. The next turn of a conversation
found only its prompt's blocks. Without graphs (``enforce_eager``) every step's hooks run and every full block is saved.
The fix ignores the layer hook and submits the save from ``wait_for_save`` using the step's metadata.

Upstream: https://github.com/novitalabs/pegaflow/pull/204 ("fix(connector): align decode save and load block
indexes", novitalabs/pegaflow, by JinYan Su (xiaguan), opened 2026-04-12, merged 2026-04-13 as commit
87f75f488368a3adf832932d7d7d955eee6f276f). Read, in a mirror of the repository: the whole diff of 87f75f4
(``python/pegaflow/connector/__init__.py``, ``worker.py``, ``scheduler.py``) and its commit message; at the parent
6008be2: ``connector/__init__.py`` (``PegaKVConnector``: ``start_load_kv``, ``wait_for_layer_load``,
``save_kv_layer``, ``wait_for_save``, the scheduler-side facade), ``worker.py`` (``SaveTask``, ``WorkerConnector``:
``__init__``, ``register_kv_caches``, ``get_finished``, ``start_load_kv``, ``save_kv_layer``, ``wait_for_save``,
``_save_worker``, ``_process_save_batch``, ``_decrement_layer_counter``), ``common.py`` (``ConnectorContext`` and
``virtual_block_size``, ``LoadIntent``, ``SaveIntent``, ``PegaConnectorMetadata``); after the fix, ``scheduler.py``
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``_consume_save_intent``,
``_count_available_block_prefix``). Also the diff of the earlier d49ba10 (#145, "mark cross-layer save intents as
completed when CUDA graph skips all ``save_kv_layer`` hooks") and issue #124 ("CUDA graph compatibility: layer-wise KV
ops require PIECEWISE mode": "``save_kv_layer()`` is skipped -> KV never saved"), as stored in the search corpus. On
vLLM's side: ``vllm/model_executor/layers/attention/kv_transfer_utils.py`` at 2b9269b2 (``maybe_transfer_kv_layer``:
no hooks when ``attn_metadata is None or not connector.has_connector_metadata()``, else ``wait_for_layer_load``,
the op, ``save_kv_layer``) and ``vllm/v1/worker/kv_connector_model_runner_mixin.py`` at 00f4240e
(``_get_kv_connector_output``: bind metadata, ``start_load_kv``, the forward, then ``wait_for_save``, ``get_finished``
and ``clear_connector_metadata``, all outside the graph). Round 135's program on vLLM #28253 told me capture-time dummy
runs bind no connector metadata.
Not read: PR #204's review (if any); the Rust server (``engine_client.save`` / ``query_prefetch`` / ``load``, the CUDA
IPC copies, SSD tiers); the cross-layer registration path beyond ``register_cross_layers_kv_cache``; ``#205`` (which
later removed the blocking wait); vLLM's ``Scheduler.schedule``, ``KVCacheManager``, ``CUDAGraphWrapper`` and
dispatcher at the revision PegaFlow ran against (I rely on round 135's reading and on vLLM's documented FULL decode
graphs). Not established: how much of the hit-rate loss the PR's benchmark owed to the graph part rather than to the
block-index part the same PR fixed (requests with an external hit); which vLLM version the author ran.
Symptom: the PR: "callback-driven save was not graph-safe under CUDA graph replay"; "remote ``mtb`` multi-round run
recovered steadily increasing cache hit rate after the fix (observed up to 93.37%)". Before it, the worker logged
"Detected %d skipped saves (CUDA graph)" and completed them unsaved.
Mechanism: the save submission is host work placed in a layer hook inside the region a FULL graph captures. At capture
the hook saw no bound metadata and did nothing; a replay re-runs only kernels, so on every graph-served decode step the
step's save intents (the block a decode token just filled) reach ``wait_for_save`` with no task behind them, and the
"skipped" fallback drops them. Eager steps run the hook and save.
Doctor: host-work-frozen, at save_kv_layer: a Python call inside the captured forward (the layer hook that submits the
save) ran once, at capture, and is skipped by every replay. ``save_kv_layer`` is where the save was submitted and what
the fix empties (``PegaKVConnector.save_kv_layer`` and ``WorkerConnector.save_kv_layer`` both become ``pass``);
``wait_for_save``, which the fix fills, is where the skipped intents were dropped.
Fix (upstream): ``save_kv_layer`` does nothing; ``start_load_kv`` keeps the step's metadata
(``_current_metadata``); ``wait_for_save`` (eager, after the forward) queues one ``SaveTask`` per step for all save
intents, ``_process_save_batch`` expands each intent to every registered layer, and the step waits for completion.
Modelled: ``PegaKVConnector`` (both roles), ``WorkerConnector`` (``register_kv_caches``, ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``_save_worker``, ``_process_save_batch``,
``_decrement_layer_counter`` / ``_complete_save_requests``, ``get_finished``), ``SchedulerConnector``
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``_consume_save_intent``,
``_count_available_block_prefix``), ``SaveTask``, ``SaveIntent``, ``PegaConnectorMetadata``, ``ConnectorContext``;
vLLM's ``KVConnectorBase_V1`` (bind/clear/has metadata), ``maybe_transfer_kv_layer``,
``unified_attention_with_output``, ``get_attention_context``, ``set_forward_context``, ``Request.block_hashes``,
``SchedulerOutput``, ``GPUModelRunner`` (``_dummy_run``, ``capture_model``, ``_prepare_inputs``, ``execute_model``).
Stand-ins: the PegaFlow server is an in-process object (``save`` copies blocks of the registered KV caches to host
memory keyed by block hash, ``query_prefetch`` counts leading hashes stored for every layer); the save thread runs in
line at the end of ``wait_for_save`` (it synchronises with the device before copying, so it reads what the step
wrote); the scheduler-side block-index alignment of the same PR is used in both variants (this workload has no
external hit, where the two indexings differ); loads, MLA/TP/DCP, cross-layer mode, drop limits and preemption are
left out. vLLM's prefix caching is off and a minimal scheduler runs prefill as one mixed batch (eager, standing for
PIECEWISE, whose attention runs between pieces) and decodes one token per request on FULL graphs of sizes 1 and 2.
The model is mine: 2 layers of width 16, one head over a paged cache ``[2, blocks, 4, 16]`` per layer (block 0 is
the null block the capture's dummy batch writes), learned positions, SiLU MLP of 32, float64, greedy.
Workload: turn 1 of two conversations, A (prompt of 6) and B (prompt of 5), 7 new tokens each: one prefill step and
six decode steps of both. Then each conversation's next turn (its tokens so far plus two) is admitted and looks the
store up. Outputs: each step's logits and tokens, the store's blocks for every full block of A and B (zeros where
absent), and the next turns' hit tokens.
Measured: the check printed
  pegaflow_204_kv_save_submitted_from_layer_hook_skipped_by_full_graph [bug] on cpu: misbehaves (max |graph - eager| = 8)
  pegaflow_204_kv_save_submitted_from_layer_hook_skipped_by_full_graph [fix] on cpu: equals eager (max |graph - eager| = 0)
Without graphs the store holds A's blocks 0-2 and B's 0-1, and the next turns hit 12 and 8 tokens; with the bug only
the prefill's blocks (A 0, B 0) are stored and both hit 4 (the 8 is A's next-turn hit difference; the stored
blocks differ by up to 3.16); the seven steps' logits and the tokens agree (A: 8 21 4 14 5 13 19, B: 5 5 7 7 21 11
17), since a miss only means recomputing. With the fix the store and hits equal eager's. About 3 s for both variants.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import torch
from torch import Tensor

from workbench.engine import events
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/novitalabs/pegaflow/pull/204"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "save_kv_layer"
SYMPTOM = ("PegaFlow's connector submitted KV saves from the per-layer save_kv_layer hook inside the attention op, "
           "which a FULL decode graph skips on replay, so blocks filled while decoding were never offloaded and "
           "multi-round cache hit rates fell")

VOCAB, DIM, FFN, BLOCK, NUM_BLOCKS, MAX_BLOCKS, MAX_TOKENS = 24, 16, 32, 4, 12, 4, 16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
CAPTURE_SIZES = (1, 2)
DTYPE = torch.float64
_variant = "bug"


# --- PegaFlow server (stand-in) and connector -----------------------------------------------------------------------

class PegaFlowServer:
    def __init__(self):
        self.kv_caches: dict[str, Tensor] = {}
        self.store: dict[bytes, dict[str, Tensor]] = {}          # block hash -> layer -> [2, BLOCK, DIM] on the host

    def register_context_batch(self, instance_id, kv_caches: dict) -> tuple[bool, str]:
        self.kv_caches = dict(kv_caches)                         # (CUDA IPC handles upstream)
        return True, "ok"

    def save(self, instance_id, tp_rank, device_id, saves_list) -> tuple[bool, str]:
        for layer_name, block_ids, block_hashes in saves_list:
            for block_id, block_hash in zip(block_ids, block_hashes):
                self.store.setdefault(block_hash, {})[layer_name] = self.kv_caches[layer_name][:, block_id].to("cpu")
        return True, "ok"

    def query_prefetch(self, instance_id, block_hashes, req_id=None) -> dict:
        hit = 0
        for h in block_hashes:
            if len(self.store.get(h, {})) < len(self.kv_caches):
                break
            hit += 1
        return {"ok": True, "prefetch_state": "done", "hit_blocks": hit}


@dataclasses.dataclass(frozen=True)
class ConnectorContext:
    instance_id: str
    block_size: int
    engine_client: PegaFlowServer
    tp_rank: int = 0
    device_id: int = 0

    @property
    def virtual_block_size(self) -> int:
        return self.block_size                                   # block_size * dcp * pcp, both 1 here


@dataclasses.dataclass(frozen=True)
class SaveIntent:
    block_ids: tuple
    block_hashes: tuple


class PegaConnectorMetadata:
    def __init__(self, load_intents=None, save_intents=None):
        self.load_intents: dict = load_intents or {}
        self.save_intents: dict[str, SaveIntent] = save_intents or {}


@dataclasses.dataclass
class SaveTask:
    metadata: PegaConnectorMetadata
    request_ids: list
    layer_name: str | None = None                                # (before the fix) one task per layer hook
    attn_metadata: object = None


class WorkerConnector:
    def __init__(self, ctx: ConnectorContext):
        self._ctx = ctx
        self._save_queue: list[SaveTask] = []                    # (stand-in) queue.Queue of the PegaSaveWorker thread
        self._req_pending_layers: dict[str, int] = {}            # before the fix
        self._current_save_intents: set[str] = set()
        self._req_pending_saves: set[str] = set()                # after the fix
        self._current_metadata: PegaConnectorMetadata | None = None
        self._completed_saves: set[str] = set()
        self._registered_layers: list[str] = []

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._registered_layers = list(kv_caches)
        self._ctx.engine_client.register_context_batch(self._ctx.instance_id, kv_caches)

    def start_load_kv(self, metadata: PegaConnectorMetadata, forward_context) -> None:
        if _variant == "bug":
            self._current_save_intents = set(metadata.save_intents.keys())
        else:
            self._current_metadata = metadata
        # (no load intents in this workload)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, metadata, layer_name, kv_layer, attn_metadata) -> None:
        if _variant == "fix":
            return            # save is metadata-driven, from wait_for_save(), so CUDA graph replay cannot suppress it
        request_ids = list(metadata.save_intents.keys())
        if not request_ids:
            return
        for req_id in request_ids:
            if req_id not in self._req_pending_layers:
                self._req_pending_layers[req_id] = len(self._registered_layers)
        self._save_queue.append(SaveTask(metadata, request_ids, layer_name, attn_metadata))

    def wait_for_save(self) -> None:
        if _variant == "bug":
            skipped_requests = self._current_save_intents - set(self._req_pending_layers)
            self._completed_saves.update(skipped_requests)      # "Detected %d skipped saves (CUDA graph)"
            self._current_save_intents = set()
        else:
            metadata, self._current_metadata = self._current_metadata, None
            if metadata is not None and metadata.save_intents:
                request_ids = list(metadata.save_intents.keys())
                self._req_pending_saves.update(request_ids)
                self._save_queue.append(SaveTask(metadata, request_ids))
        self._save_worker()             # (stand-in) the save thread, which the fix's wait_for_save waits for

    def _save_worker(self) -> None:
        batch, self._save_queue = self._save_queue, []
        if batch:
            self._process_save_batch(batch)

    def _process_save_batch(self, batch: list[SaveTask]) -> None:
        saves_by_layer: dict[str, tuple[list, list]] = {}
        all_request_ids: list[str] = []
        for task in batch:
            all_request_ids.extend(task.request_ids)
            if _variant == "bug" and (getattr(task.attn_metadata, "block_table", None) is None
                                      and getattr(task.attn_metadata, "slot_mapping", None) is None):
                continue
            for save_intent in task.metadata.save_intents.values():
                if not save_intent.block_ids:
                    continue
                target_layers = (task.layer_name,) if _variant == "bug" else tuple(self._registered_layers)
                for layer_name in target_layers:
                    ids, hashes = saves_by_layer.setdefault(layer_name, ([], []))
                    ids.extend(save_intent.block_ids)
                    hashes.extend(save_intent.block_hashes)
        if saves_by_layer:
            if torch.cuda.is_available() and any(t.is_cuda for t in self._ctx.engine_client.kv_caches.values()):
                torch.cuda.synchronize()            # the attention kernels are async: wait before reading the cache
            saves_list = [(name, ids, hashes) for name, (ids, hashes) in saves_by_layer.items()]
            self._ctx.engine_client.save(self._ctx.instance_id, self._ctx.tp_rank, self._ctx.device_id, saves_list)
        if _variant == "bug":
            self._decrement_layer_counter(all_request_ids)
        else:
            self._complete_save_requests(all_request_ids)

    def _decrement_layer_counter(self, request_ids) -> None:
        for req_id in request_ids:
            if req_id in self._req_pending_layers:
                self._req_pending_layers[req_id] -= 1
                if self._req_pending_layers[req_id] == 0:
                    del self._req_pending_layers[req_id]
                    self._completed_saves.add(req_id)

    def _complete_save_requests(self, request_ids) -> None:
        for req_id in request_ids:
            if req_id in self._req_pending_saves:
                self._req_pending_saves.discard(req_id)
                self._completed_saves.add(req_id)

    def get_finished(self, finished_req_ids: set) -> set:
        done = self._completed_saves & finished_req_ids
        self._completed_saves -= done
        return done


class SchedulerConnector:
    def __init__(self, ctx: ConnectorContext):
        self._ctx = ctx
        self._block_hashes: dict[str, tuple] = {}
        self._external_matched_blocks: dict[str, int] = {}
        self._block_index_offsets: dict[str, int] = {}
        self._allocated_blocks: dict[str, list] = {}
        self._scheduled_tokens: dict[str, int] = {}
        self._next_stored_block_idx: dict[str, int] = {}
        self._requests: dict[str, Request] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        computed_blocks = num_computed_tokens // self._ctx.virtual_block_size
        remaining_hashes = request.block_hashes[computed_blocks:]
        if not remaining_hashes:
            self._external_matched_blocks[request.request_id] = computed_blocks
            return 0, False
        hit_blocks = self._count_available_block_prefix(remaining_hashes, request.request_id)
        self._external_matched_blocks[request.request_id] = computed_blocks + hit_blocks
        num_hit_tokens = hit_blocks * self._ctx.virtual_block_size
        return (num_hit_tokens, True) if num_hit_tokens > 0 else (0, False)

    def _count_available_block_prefix(self, block_hashes, req_id) -> int:
        result = self._ctx.engine_client.query_prefetch(self._ctx.instance_id, list(block_hashes), req_id=req_id)
        return result.get("hit_blocks", 0)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._block_hashes[req_id] = tuple(request.block_hashes)
        if req_id not in self._allocated_blocks:
            base_block_idx = self._external_matched_blocks.get(req_id, 0)
            self._block_index_offsets[req_id] = base_block_idx
            self._allocated_blocks[req_id] = []
            self._scheduled_tokens[req_id] = 0
            self._next_stored_block_idx[req_id] = base_block_idx
        assert num_external_tokens == 0                          # (loads are not modelled)

    def build_connector_meta(self, scheduler_output) -> PegaConnectorMetadata:
        save_intents: dict[str, SaveIntent] = {}
        for req in scheduler_output.scheduled_new_reqs:
            self._allocated_blocks[req.req_id] = list(req.block_ids[0])
            self._scheduled_tokens[req.req_id] += scheduler_output.num_scheduled_tokens[req.req_id]
            if save_intent := self._consume_save_intent(req.req_id):
                save_intents[req.req_id] = save_intent
        cached = scheduler_output.scheduled_cached_reqs
        for idx, req_id in enumerate(cached.req_ids):
            self._block_hashes[req_id] = tuple(self._requests[req_id].block_hashes)   # blocks filled by decode
            self._scheduled_tokens[req_id] += scheduler_output.num_scheduled_tokens[req_id]
            if cached.new_block_ids[idx]:
                self._allocated_blocks[req_id].extend(cached.new_block_ids[idx][0])
            if save_intent := self._consume_save_intent(req_id):
                save_intents[req_id] = save_intent
        return PegaConnectorMetadata(save_intents=save_intents)

    def _consume_save_intent(self, req_id: str) -> SaveIntent | None:
        block_hashes = self._block_hashes[req_id]
        allocated, scheduled = self._allocated_blocks[req_id], self._scheduled_tokens[req_id]
        base_block_idx = self._block_index_offsets[req_id]
        start_block_idx = self._next_stored_block_idx[req_id]
        local_saveable = min(len(allocated), scheduled // self._ctx.virtual_block_size)
        saveable_block_idx = min(len(block_hashes), base_block_idx + local_saveable)
        new_blocks = saveable_block_idx - start_block_idx
        if new_blocks <= 0:
            return None
        self._next_stored_block_idx[req_id] = saveable_block_idx
        local_start = start_block_idx - base_block_idx
        return SaveIntent(tuple(allocated[local_start:local_start + new_blocks]),
                          tuple(block_hashes[start_block_idx:start_block_idx + new_blocks]))


class KVConnectorBase_V1:
    def __init__(self):
        self._connector_metadata = None

    def bind_connector_metadata(self, metadata) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata


class PegaKVConnector(KVConnectorBase_V1):
    def __init__(self, role: str, ctx: ConnectorContext):
        super().__init__()
        self._scheduler = SchedulerConnector(ctx) if role == "scheduler" else None
        self._worker = WorkerConnector(ctx) if role == "worker" else None

    def start_load_kv(self, forward_context) -> None:
        self._worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Tensor, attn_metadata) -> None:
        if _variant == "fix":
            return            # layer callbacks are ignored so CUDA graph replay cannot suppress save submission
        metadata = self._get_connector_metadata()
        self._worker.save_kv_layer(metadata, layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set) -> set:
        return self._worker.get_finished(finished_req_ids)


_KV_CONNECTOR_AGENT: PegaKVConnector | None = None


def has_kv_transfer_group() -> bool:
    return _KV_CONNECTOR_AGENT is not None


def get_kv_transfer_group() -> PegaKVConnector:
    return _KV_CONNECTOR_AGENT


# --- vLLM forward context, attention, model -------------------------------------------------------------------------

@dataclasses.dataclass
class AttentionMetadata:          # views of the runner's persistent buffers, one row per query token
    slot_mapping: Tensor
    block_table: Tensor
    seq_lens: Tensor


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: dict | None
    no_compile_layers: dict


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata, layers):
    global _forward_context
    prev, _forward_context = _forward_context, ForwardContext(attn_metadata, layers)
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> ForwardContext:
    return _forward_context


def get_attention_context(layer_name: str):
    fc = get_forward_context()
    attn_metadata = fc.attn_metadata[layer_name] if fc.attn_metadata is not None else None
    layer = fc.no_compile_layers[layer_name]
    return attn_metadata, layer, layer.kv_cache, None


def maybe_transfer_kv_layer(func):
    def wrapper(query, key, value, output, layer_name):
        if not has_kv_transfer_group():
            return func(query, key, value, output, layer_name)
        attn_metadata, _, kv_cache, _ = get_attention_context(layer_name)
        connector = get_kv_transfer_group()
        if attn_metadata is None or not connector.has_connector_metadata():
            return func(query, key, value, output, layer_name)
        connector.wait_for_layer_load(layer_name)
        result = func(query, key, value, output, layer_name)
        connector.save_kv_layer(layer_name, kv_cache, attn_metadata)
        return result
    return wrapper


@maybe_transfer_kv_layer
def unified_attention_with_output(query, key, value, output, layer_name):
    md, _, kv_cache, _ = get_attention_context(layer_name)
    n = query.shape[0]
    kv = kv_cache.view(2, NUM_BLOCKS * BLOCK, DIM)
    kv[0].index_copy_(0, md.slot_mapping[:n], key)                # reshape_and_cache_flash
    kv[1].index_copy_(0, md.slot_mapping[:n], value)
    ctx = torch.arange(MAX_BLOCKS * BLOCK, device=query.device)
    slots = md.block_table[:n][:, ctx // BLOCK] * BLOCK + ctx % BLOCK
    scores = (kv[0][slots] @ query[:, :, None]).squeeze(-1) / DIM ** 0.5
    scores = scores.masked_fill(ctx[None, :] >= md.seq_lens[:n, None], float("-inf"))
    output.copy_((torch.softmax(scores, -1)[:, :, None] * kv[1][slots]).sum(1))


class Attention:
    def __init__(self, layer_name: str, device):
        self.layer_name = layer_name
        self.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK, DIM, dtype=DTYPE, device=device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        output = torch.empty_like(q)
        unified_attention_with_output(q, k, v, output, self.layer_name)
        return output


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Model:
    def __init__(self, device):
        gen = generator(204)

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale).to(device)
        self.embed, self.pos = w(VOCAB, DIM), w(MAX_BLOCKS * BLOCK, DIM)
        self.layers = [dict(norm1=w(DIM, scale=0.1) + 1, norm2=w(DIM, scale=0.1) + 1, wq=w(DIM, DIM, scale=DIM ** -0.5),
                            wk=w(DIM, DIM, scale=DIM ** -0.5), wv=w(DIM, DIM, scale=DIM ** -0.5),
                            wo=w(DIM, DIM, scale=DIM ** -0.5), w1=w(DIM, FFN, scale=DIM ** -0.5),
                            w2=w(FFN, DIM, scale=FFN ** -0.5)) for _ in LAYER_NAMES]
        self.attn = {name: Attention(name, device) for name in LAYER_NAMES}
        self.lm_head = w(DIM, VOCAB, scale=1.5)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h = self.embed[input_ids] + self.pos[positions]
        for p, name in zip(self.layers, LAYER_NAMES):
            x = rms_norm(h, p["norm1"])
            h = h + self.attn[name].forward(x @ p["wq"], x @ p["wk"], x @ p["wv"]) @ p["wo"]
            g = rms_norm(h, p["norm2"]) @ p["w1"]
            h = h + (g * torch.sigmoid(g)) @ p["w2"]
        return h @ self.lm_head


# --- vLLM scheduler (minimal stand-in) and runner -------------------------------------------------------------------

@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list
    max_tokens: int
    output_token_ids: list = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def block_hashes(self) -> list:
        hashes, parent, toks = [], b"", self.all_token_ids
        for i in range(len(toks) // BLOCK):
            parent = hashlib.sha256(parent + bytes(toks[i * BLOCK:(i + 1) * BLOCK])).digest()
            hashes.append(parent)
        return hashes


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list
    new_block_ids: list


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict
    finished_req_ids: set
    kv_connector_metadata: PegaConnectorMetadata | None = None


class Scheduler:
    def __init__(self, connector: PegaKVConnector):
        self.connector = connector._scheduler
        self.free_blocks, self.block_tables = list(range(1, NUM_BLOCKS)), {}
        self.waiting, self.running, self.finished_req_ids = [], [], set()

    def _allocate(self, req: Request, num_tokens: int) -> list:
        table = self.block_tables.setdefault(req.request_id, [])
        new = []
        while len(table) * BLOCK < num_tokens:
            new.append(self.free_blocks.pop(0))
            table.append(new[-1])
        return new

    def schedule(self) -> SchedulerOutput:
        num_sched, cached_ids, cached_new, new_reqs = {}, [], [], []
        for req in self.running:
            num_sched[req.request_id] = 1
            new = self._allocate(req, req.num_computed_tokens + 1)
            cached_ids.append(req.request_id)
            cached_new.append((new,) if new else None)
        for req in self.waiting:
            num_external, _ = self.connector.get_num_new_matched_tokens(req, 0)
            blocks = self._allocate(req, len(req.all_token_ids))
            self.connector.update_state_after_alloc(req, blocks, num_external)
            new_reqs.append(NewRequestData(req.request_id, (list(self.block_tables[req.request_id]),)))
            num_sched[req.request_id] = len(req.all_token_ids)
            self.running.append(req)
        self.waiting = []
        so = SchedulerOutput(new_reqs, CachedRequestData(cached_ids, cached_new), num_sched, self.finished_req_ids)
        self.finished_req_ids = set()
        so.kv_connector_metadata = self.connector.build_connector_meta(so)
        return so

    def update_from_output(self, so: SchedulerOutput, logits: Tensor) -> None:
        last = torch.cumsum(torch.tensor([so.num_scheduled_tokens[r.request_id] for r in self.running]), 0) - 1
        for req, row in zip(list(self.running), last.tolist()):
            req.num_computed_tokens += so.num_scheduled_tokens[req.request_id]
            req.output_token_ids.append(int(logits[row].argmax()))
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self.free_blocks.extend(self.block_tables.pop(req.request_id))
                self.finished_req_ids.add(req.request_id)


class GPUModelRunner:
    def __init__(self, device, enforce_eager: bool):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = Model(device)
        self.kv_caches = {name: attn.kv_cache for name, attn in self.model.attn.items()}

        def z(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = z(MAX_TOKENS), z(MAX_TOKENS), z(MAX_TOKENS)
        self.block_table, self.seq_lens = z(MAX_TOKENS, MAX_BLOCKS), z(MAX_TOKENS)
        self.cudagraphs: dict[int, tuple] = {}

    def _attn_metadata(self) -> dict:
        md = AttentionMetadata(self.slot_mapping, self.block_table, self.seq_lens)
        return {name: md for name in LAYER_NAMES}

    def _model_forward(self, num_tokens: int) -> Tensor:
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _dummy_run(self, num_tokens: int) -> None:
        """A uniform decode batch of dummy requests on the null block; no connector metadata is bound."""
        with set_forward_context(self._attn_metadata(), self.model.attn):
            self.cudagraphs[num_tokens] = capture(lambda: self._model_forward(num_tokens), device=self.device,
                                                  warmups=1, name=f"FULL decode {num_tokens}",
                                                  owner="vLLM GPUModelRunner")

    def capture_model(self) -> None:
        events.static_buffers("vLLM GPUModelRunner", {
            "input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
            "block_table": self.block_table, "seq_lens": self.seq_lens})
        events.persistent_state("vLLM GPUModelRunner", {f"{n}.kv_cache": t for n, t in self.kv_caches.items()})
        self.seq_lens.fill_(1)
        for n in sorted(CAPTURE_SIZES, reverse=True):
            self._dummy_run(n)

    def _prepare_inputs(self, so: SchedulerOutput, requests: dict, block_tables: dict) -> int:
        ids, pos, slots, tables, lens = [], [], [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            req, table = requests[req_id], block_tables[req_id]
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                ids.append(req.all_token_ids[p])
                pos.append(p)
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
                tables.append(table + [0] * (MAX_BLOCKS - len(table)))
                lens.append(p + 1)
        t = len(ids)
        for buf, data in ((self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots),
                          (self.block_table, tables), (self.seq_lens, lens)):
            buf[:t].copy_(torch.tensor(data, dtype=torch.long).to(self.device))
        return t

    def execute_model(self, so: SchedulerOutput, requests: dict, block_tables: dict) -> Tensor:
        n = self._prepare_inputs(so, requests, block_tables)
        uniform_decode = not so.scheduled_new_reqs and n == len(so.num_scheduled_tokens)
        connector = get_kv_transfer_group()
        with set_forward_context(self._attn_metadata(), self.model.attn):
            connector.bind_connector_metadata(so.kv_connector_metadata)        # _get_kv_connector_output
            connector.start_load_kv(get_forward_context())
            try:
                if not self.enforce_eager and uniform_decode and n in self.cudagraphs:
                    graph, logits = self.cudagraphs[n]
                    logits = replay(graph, logits).clone()
                else:                                 # eager, or a mixed batch (PIECEWISE: attention runs eagerly)
                    logits = self._model_forward(n).clone()
            finally:
                connector.wait_for_save()
                connector.get_finished(so.finished_req_ids)
                connector.clear_connector_metadata()
        return logits


def serve(device, enforce_eager: bool) -> list:
    global _KV_CONNECTOR_AGENT
    server = PegaFlowServer()
    ctx = ConnectorContext("vllm-0", BLOCK, server)
    scheduler = Scheduler(PegaKVConnector("scheduler", ctx))
    _KV_CONNECTOR_AGENT = PegaKVConnector("worker", ctx)
    try:
        runner = GPUModelRunner(device, enforce_eager)
        _KV_CONNECTOR_AGENT._worker.register_kv_caches(runner.kv_caches)
        if not enforce_eager:
            runner.capture_model()
        turn1 = [Request("A", [3, 17, 5, 9, 1, 22], 7), Request("B", [8, 2, 20, 11, 6], 7)]
        scheduler.waiting.extend(turn1)
        requests = {r.request_id: r for r in turn1}
        outputs = []
        while scheduler.running or scheduler.waiting:
            so = scheduler.schedule()
            logits = runner.execute_model(so, requests, scheduler.block_tables)
            scheduler.update_from_output(so, logits)
            outputs.append(logits)
        outputs.append(torch.tensor([r.output_token_ids for r in turn1]))
        zeros = torch.zeros(2, BLOCK, DIM, dtype=DTYPE)
        stored = [torch.stack([server.store.get(h, {}).get(name, zeros) for name in LAYER_NAMES])
                  for r in turn1 for h in r.block_hashes]
        outputs.append(torch.stack(stored))
        hits = [scheduler.connector.get_num_new_matched_tokens(Request(r.request_id + "'", r.all_token_ids + [4, 7], 4),
                                                               0)[0] for r in turn1]          # the next turns
        outputs.append(torch.tensor(hits, dtype=DTYPE))
        return outputs
    finally:
        _KV_CONNECTOR_AGENT = None


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, enforce_eager=False), lambda: serve(device, enforce_eager=True))
