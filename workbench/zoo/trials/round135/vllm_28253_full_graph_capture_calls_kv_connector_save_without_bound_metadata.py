"""vLLM V1 with a KV connector (here the ``SharedStorageConnector`` of the disaggregated-prefill example) and the
default ``FULL_AND_PIECEWISE`` CUDA graphs: the attention op ``unified_attention_with_output`` calls the connector's
layer hooks (``wait_for_kv_layer_from_connector`` before attention, ``maybe_save_kv_layer_to_connector`` after). At
serving time the runner binds the step's connector metadata around the forward, but the FULL decode capture runs the
forward from ``_dummy_run`` (a warmup with ``force_attention`` and then the capture) with attention metadata built and
no connector metadata bound, so the save hook reaches ``SharedStorageConnector.save_kv_layer`` ->
``_get_connector_metadata`` and its ``assert self._connector_metadata is not None`` fails: the engine dies while
capturing. Without graphs (``enforce_eager``) no dummy run builds attention metadata, the hooks return early, and the
same workload is served.

Upstream: https://github.com/vllm-project/vllm/pull/28253 ("[BugFix] Avoid calling KV connector layer APIs when
metadata is unset", vllm-project/vllm, by David Ben-David (sdavidbd), opened 2025-11-06, merged 2025-11-11 as commit
cc079763c59adb8c03305663a5b8857ba85deb1b; LGTM by markmc), fixing issue #26675 ("[Bug]:AssertionError: assert
self._connector_metadata is not None when using graph mode"). Read, in a stored mirror of vLLM's history
(local-inference-lab/vllm): the whole diff of cc079763c (``vllm/attention/layer.py``: an early return
``if not connector.has_connector_metadata()`` in ``wait_for_kv_layer_from_connector`` and
``maybe_save_kv_layer_to_connector``; ``kv_connector/v1/base.py``: new ``has_connector_metadata``;
``multi_connector.py``: ``bind/clear_connector_metadata`` also call the base class). At the parent cc079763c^:
``attention/layer.py`` (both hooks, ``unified_attention_with_output``, ``unified_mla_attention``),
``shared_storage_connector.py`` (whole file: ``ReqMeta.make_meta``, ``start_load_kv``, ``wait_for_layer_load``,
``save_kv_layer``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``_found_match_for_prompt``, ``align_to_block_size``), ``kv_connector/v1/base.py`` (``bind_connector_metadata``,
``clear_connector_metadata``, ``_get_connector_metadata``), ``v1/worker/kv_connector_model_runner_mixin.py``
(``maybe_get_kv_connector_output``, ``_get_kv_connector_output``), ``v1/worker/gpu_model_runner.py``
(``execute_model`` up to the forward, ``_dummy_run``'s ``force_attention`` / FULL metadata block,
``capture_model``, ``_capture_cudagraphs``), ``compilation/cuda_graph.py`` (``CUDAGraphWrapper.__call__``),
``gpu_worker.py`` (``ensure_kv_transfer_initialized`` before ``compile_or_warm_up_model`` -> ``capture_model``).
Also read: the PR description and the issue's body as stored in the search corpora.
Not read: the issue's seven comments (not stored) and the tail of its traceback (the stored excerpt stops in
``LLMEngine.from_engine_args``); the review of #27026 the PR refers to; other connectors (NIXL, LMCache,
MultiConnector beyond the diff); the scheduler's real connector plumbing (``Scheduler.schedule``,
``KVCacheManager``); the PIECEWISE backend; the FlashAttention kernels. Not established: which dummy run failed first
in the report (from the code it is the FULL capture's first warmup, which passes ``force_attention=True``; the
excerpt shows the PIECEWISE capture finished, ``67/67``, before the error).
Symptom: #26675 (vLLM 0.11): running ``examples/offline_inference/disaggregated-prefill-v1/run.sh`` with
``SharedStorageConnector``: "If not using graph mode with ``enforce_eager = True``, there is no problem; However, if
we remove the ``enforce_eager = True``, using the graph mode, there occurs an error" -- "AssertionError: assert
self._connector_metadata is not None", raised while ``LLM(...)`` is being built, after "Capturing CUDA graphs (mixed
prefill-decode, PIECEWISE): 100% ... 67/67". The PR: "Full-graph capture completes successfully with the KV connector
enabled".
Mechanism: the connector's per-layer hooks are host Python inside the attention op. With PIECEWISE graphs the
attention op is a splitting op and runs eagerly every step, inside ``_get_kv_connector_output``, which binds the
step's ``kv_connector_metadata`` and clears it afterwards; PIECEWISE capture runs have ``attn_metadata`` None, so the
hooks return at once. A FULL graph captures the attention op too: ``_capture_cudagraphs`` calls ``_dummy_run`` with
``force_attention=True`` (warmup) and with ``CUDAGraphMode.FULL`` (capture), both of which build attention metadata,
while nothing binds connector metadata -- only ``execute_model`` does. ``maybe_save_kv_layer_to_connector`` sees
attention metadata, calls ``save_kv_layer``, and the connector asserts. (Had the capture survived, the hooks would
have run once, at capture, and never at replay; for this connector the decode steps a FULL graph serves save and
load nothing, so replay and eager agree.)
Doctor: host-work-frozen, at maybe_save_kv_layer_to_connector. The KV connector's layer API is host work placed
inside the region a FULL graph captures, and it reads a per-step binding (the connector metadata) that only a served
step sets; the capture-time runs execute it without that binding. ``maybe_save_kv_layer_to_connector`` is the hook
that reaches the assertion and one of the two functions the fix changes (``wait_for_kv_layer_from_connector`` gets
the same guard but ``SharedStorageConnector.wait_for_layer_load`` never asserts). warmup-divergence is arguable too:
the failing run is the capture routine's warmup.
Fix (upstream): both hooks return early when ``connector.has_connector_metadata()`` is False, i.e. in capture and
warmup dummy runs; the PR calls this "temporarily disables graph capture for the KV connector path". Served steps
are unchanged: PIECEWISE (here eager) steps still run the hooks with bound metadata.
Modelled: ``ForwardContext`` / ``set_forward_context`` / ``get_forward_context``; ``KVConnectorBase_V1``
(``bind_connector_metadata``, ``clear_connector_metadata``, ``_get_connector_metadata``, ``has_connector_metadata``);
``ReqMeta.make_meta``, ``SharedStorageConnectorMetadata``, ``SharedStorageConnector`` (``start_load_kv`` with
``inject_kv_into_layer``, ``wait_for_layer_load``, ``save_kv_layer`` with ``extract_kv_from_layer``,
``wait_for_save``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``_found_match_for_prompt``, ``_generate_foldername_debug``, ``_generate_filename_debug``), ``align_to_block_size``,
``has_kv_transfer_group`` / ``get_kv_transfer_group``; ``wait_for_kv_layer_from_connector``,
``maybe_save_kv_layer_to_connector`` (bug / fix as in the diff), ``unified_attention_with_output``, ``Attention``;
``CUDAGraphWrapper.__call__`` (capture on the first FULL call of a batch descriptor, replay after);
``CudagraphDispatcher.dispatch``; ``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output`` /
``_get_kv_connector_output``; ``GPUModelRunner`` (``_dummy_run``, ``capture_model``, ``_capture_cudagraphs`` with
``cudagraph_num_of_warmups`` = 1, ``_prepare_inputs``, ``execute_model``).
Stand-ins: a two-layer Llama-like model in float64 (learned position embedding instead of RoPE); the attention kernel
is static-shape torch over a paged cache ``[2, num_blocks, block_size, heads, head_dim]`` (a ``PAD_SLOT_ID`` write
lands in null block 0); the shared storage path is an in-memory dict keyed like upstream's files (md5 folder /
``<layer>.safetensors``), ``save_file`` / ``load_file`` are a host copy and ``.to(device)``; ``os.path.exists`` of
the folder is a key-prefix test; mixed (prefill) batches run eagerly instead of on PIECEWISE graphs, whose capture is
not modelled (its dummy runs have no attention metadata, so they never reach the hooks); a minimal scheduler
allocates a request's blocks at admission, schedules a prompt's uncached tokens in one step and one token per
decode, greedy sampling; no preemption, spec decode, LoRA, DP or MLA.
Workload: capture sizes [1, 2, 4], block size 4. A prefill instance (kv producer) serves prompts A (9 tokens) and
B (6 tokens): one mixed step (eager) that stores 8 and 4 tokens of KV per layer, then two decode steps of 2 requests
(the FULL graph of size 2). A decode instance (kv consumer) over the same storage serves A and B each extended by the
producer's first token: external hits of 8 and 4 tokens, ``start_load_kv`` injects them, one mixed step computes the
remaining 2 + 3 tokens, then two FULL decode steps. Outputs: each step's logits and sampled tokens.
Measured: bug: misbehaves (raised AssertionError: ), raised by ``_get_connector_metadata`` in the FULL capture's
first warmup (size 4) of the producer, via ``maybe_save_kv_layer_to_connector`` -> ``save_kv_layer``. Fix: equals
eager (max |graph - eager| = 0); the consumer's first sampled tokens equal the producer's second ones, so the
loaded KV is the stored KV.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib

import numpy as np
import torch

from workbench.engine import events, graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/28253"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "maybe_save_kv_layer_to_connector"
SYMPTOM = ("vLLM V1 with a KV connector (SharedStorageConnector) and FULL_AND_PIECEWISE graphs dies while capturing "
           "the FULL decode graphs: the attention op's connector save hook runs in the capture-time dummy runs, where "
           "no connector metadata is bound, and asserts")

BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_REQS, MAX_NUM_TOKENS = 4, 16, 4, 32
MAX_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ     # block 0 is the null block
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4]
VOCAB, HIDDEN, NUM_HEADS, HEAD_DIM, NUM_LAYERS = 32, 16, 2, 8, 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
PAD_SLOT_ID = -1
DTYPE = torch.float64

_variant = "bug"


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_AND_PIECEWISE = 3


# --- vllm/forward_context.py (reduced) --------------------------------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    no_compile_layers: dict
    attn_metadata: dict | None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: tuple | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Forward context is not set."
    return _forward_context


@contextlib.contextmanager
def set_forward_context(attn_metadata, no_compile_layers, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                        batch_descriptor=None):
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(no_compile_layers, attn_metadata, cudagraph_runtime_mode, batch_descriptor)
    try:
        yield
    finally:
        _forward_context = prev


# --- vllm/distributed/kv_transfer/kv_connector/v1: base.py and shared_storage_connector.py (reduced) ------------------

class KVConnectorBase_V1:
    def __init__(self, role: str):
        self._connector_metadata = None
        self._role = role

    def bind_connector_metadata(self, connector_metadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self):
        # Should only be called while set to valid metadata.
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:          # added by the fix
        return self._connector_metadata is not None


def align_to_block_size(num_tokens: int, block_size) -> int:
    return (num_tokens - 1) // block_size * block_size


@dataclasses.dataclass
class ReqMeta:
    token_ids: torch.Tensor
    slot_mapping: torch.Tensor
    is_store: bool

    @staticmethod
    def make_meta(token_ids, block_ids, block_size, is_store) -> ReqMeta:
        valid_num_tokens = align_to_block_size(len(token_ids), block_size)
        block_ids_tensor = torch.tensor(block_ids)
        slot_mapping = (torch.arange(0, block_size).reshape((1, block_size))
                        + block_ids_tensor.reshape((block_ids_tensor.shape[0], 1)) * block_size)
        return ReqMeta(torch.tensor(token_ids)[:valid_num_tokens], slot_mapping.flatten()[:valid_num_tokens], is_store)


@dataclasses.dataclass
class SharedStorageConnectorMetadata:
    requests: list = dataclasses.field(default_factory=list)

    def add_request(self, token_ids, block_ids, block_size, is_store) -> None:
        self.requests.append(ReqMeta.make_meta(token_ids, block_ids, block_size, is_store))


class SharedStorageConnector(KVConnectorBase_V1):
    """Saves / loads the prompt KV per layer. Stand-in: ``storage`` (a dict) for the shared storage path's files."""

    def __init__(self, role: str, storage: dict):
        super().__init__(role)
        self._block_size = BLOCK_SIZE
        self._requests_need_load: dict = {}
        self._storage = storage

    # worker side
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        def inject_kv_into_layer(dst_kv_cache_layer, src_kv_cache, slot_mapping):
            num_pages, page_size = dst_kv_cache_layer.shape[1], dst_kv_cache_layer.shape[2]
            dst_kv_cache_layer.view(2, num_pages * page_size, -1)[:, slot_mapping, ...] = src_kv_cache

        metadata = self._get_connector_metadata()
        if forward_context.attn_metadata is None:
            return
        for request in metadata.requests:
            if request.is_store:
                continue
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_cache_layer = layer.kv_cache[0]
                filename = self._generate_filename_debug(layer_name, request.token_ids)
                kv_cache = self._storage[filename].to(kv_cache_layer.device)   # safetensors load_file(...).cuda()
                inject_kv_into_layer(kv_cache_layer, kv_cache, request.slot_mapping)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        def extract_kv_from_layer(layer, slot_mapping):
            num_pages, page_size = layer.shape[1], layer.shape[2]
            return layer.reshape(2, num_pages * page_size, -1)[:, slot_mapping, ...]

        connector_metadata = self._get_connector_metadata()
        for request in connector_metadata.requests:
            if request.is_store:
                filename = self._generate_filename_debug(layer_name, request.token_ids)
                kv_cache = extract_kv_from_layer(kv_layer, request.slot_mapping)
                self._storage[filename] = kv_cache.detach().to("cpu", copy=True)   # safetensors save_file

    def wait_for_save(self):
        return

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self._found_match_for_prompt(request.prompt_token_ids):
            return 0, False
        num_tokens_to_check = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        return num_tokens_to_check - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int):
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output) -> SharedStorageConnectorMetadata:
        meta = SharedStorageConnectorMetadata()
        total_need_load = 0
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids
            if new_req.req_id in self._requests_need_load:
                meta.add_request(token_ids, new_req.block_ids[0], self._block_size, is_store=False)
                total_need_load += 1
            elif not self._found_match_for_prompt(token_ids):
                meta.add_request(token_ids, new_req.block_ids[0], self._block_size, is_store=True)
        # (requests resumed from preemption are not modelled: none are preempted here)
        assert total_need_load == len(self._requests_need_load)
        self._requests_need_load.clear()
        return meta

    def _found_match_for_prompt(self, prompt_token_ids) -> bool:
        num_tokens_to_check = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        foldername = self._generate_foldername_debug(torch.tensor(prompt_token_ids)[:num_tokens_to_check])
        return any(name.startswith(foldername + "/") for name in self._storage)    # os.path.exists(foldername)

    def _generate_foldername_debug(self, token_ids: torch.Tensor) -> str:
        return hashlib.md5(token_ids.numpy().tobytes(), usedforsecurity=False).hexdigest()

    def _generate_filename_debug(self, layer_name: str, token_ids: torch.Tensor) -> str:
        return f"{self._generate_foldername_debug(token_ids)}/{layer_name}.safetensors"


_kv_transfer_group: SharedStorageConnector | None = None


def has_kv_transfer_group() -> bool:
    return _kv_transfer_group is not None


def get_kv_transfer_group() -> SharedStorageConnector:
    return _kv_transfer_group


# --- vllm/attention/layer.py (reduced): the attention op and its connector hooks --------------------------------------

def wait_for_kv_layer_from_connector(layer_name: str):
    if not has_kv_transfer_group():
        return
    connector = get_kv_transfer_group()
    if _variant == "fix" and not connector.has_connector_metadata():
        return
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    assert isinstance(attn_metadata, dict)
    connector.wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: torch.Tensor):
    if not has_kv_transfer_group():
        return
    connector = get_kv_transfer_group()
    if _variant == "fix" and not connector.has_connector_metadata():
        return
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    assert isinstance(attn_metadata, dict)
    connector.save_kv_layer(layer_name, kv_cache_layer, attn_metadata[layer_name])


def unified_attention_with_output(query, key, value, output, layer_name: str) -> None:
    wait_for_kv_layer_from_connector(layer_name)
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata[layer_name]
    self = forward_context.no_compile_layers[layer_name]
    kv_cache = self.kv_cache[0]
    self.impl.forward(self, query, key, value, kv_cache, attn_metadata, output=output)
    maybe_save_kv_layer_to_connector(layer_name, kv_cache)


@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class FlashAttentionImpl:
    """Stand-in for FlashAttention: static-shape torch (a slot of PAD_SLOT_ID is written into the null block)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        n = attn_metadata.num_actual_tokens
        flat = kv_cache.view(2, NUM_BLOCKS * BLOCK_SIZE, NUM_HEADS, HEAD_DIM)
        slots = attn_metadata.slot_mapping[:n]
        slots = torch.where(slots >= 0, slots, torch.zeros_like(slots))
        flat[0].index_copy_(0, slots, key[:n])                   # reshape_and_cache_flash
        flat[1].index_copy_(0, slots, value[:n])
        qsl, seq_lens = attn_metadata.query_start_loc, attn_metadata.seq_lens
        t = torch.arange(n, dtype=qsl.dtype, device=query.device)
        b = torch.searchsorted(qsl[1:], t, right=True).clamp(max=qsl.shape[0] - 2)
        context_pos = seq_lens[b] - (qsl[1:][b] - t)
        j = torch.arange(MAX_MODEL_LEN, device=query.device)
        kv_slots = attn_metadata.block_table[b][:, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        scores = torch.einsum("nhd,nlhd->nhl", query[:n], flat[0][kv_slots]) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~(j[None, :] <= context_pos[:, None])[:, None, :], float("-inf"))
        output[:n] = torch.einsum("nhl,nlhd->nhd", torch.softmax(scores, dim=-1), flat[1][kv_slots])


class Attention:
    def __init__(self, layer_name, device):
        self.layer_name, self.impl = layer_name, FlashAttentionImpl()
        self.kv_cache = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)]

    def forward(self, q, k, v):
        output = torch.empty_like(q)
        unified_attention_with_output(q, k, v, output, self.layer_name)
        return output


class LlamaForCausalLM:
    def __init__(self, device):
        gen = generator(28253)
        r = lambda *s, scale=0.3: randn(*s, gen=gen, device=device, scale=scale).to(DTYPE)
        self.embed_tokens, self.pos_embed, self.lm_head = r(VOCAB, HIDDEN, scale=1.0), r(MAX_MODEL_LEN, HIDDEN), \
            r(HIDDEN, VOCAB)
        self.layers = [{"qkv": r(HIDDEN, 3 * HIDDEN), "o": r(HIDDEN, HIDDEN), "up": r(HIDDEN, 2 * HIDDEN),
                        "down": r(2 * HIDDEN, HIDDEN), "attn": Attention(name, device)} for name in LAYER_NAMES]

    def forward(self, input_ids, positions):
        h = self.embed_tokens[input_ids] + self.pos_embed[positions]
        n = h.shape[0]
        for layer in self.layers:
            q, k, v = (h @ layer["qkv"]).view(n, 3, NUM_HEADS, HEAD_DIM).unbind(1)
            h = h + layer["attn"].forward(q, k, v).reshape(n, HIDDEN) @ layer["o"]
            h = h + torch.nn.functional.silu(h @ layer["up"]) @ layer["down"]
        return h

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


# --- vllm/compilation/cuda_graph.py, vllm/v1/cudagraph_dispatcher.py (reduced) ----------------------------------------

class CUDAGraphWrapper:
    """FULL graphs of the whole forward, one per batch descriptor, captured on first FULL call, then replayed."""

    def __init__(self, runnable, device, runtime_mode=CUDAGraphMode.FULL):
        self.runnable, self.device, self.runtime_mode = runnable, device, runtime_mode
        self.graph_pool = graph_pool_handle(device)
        self.concrete_cudagraph_entries: dict = {}

    def __call__(self, *args):
        forward_context = get_forward_context()
        if forward_context.cudagraph_runtime_mode != self.runtime_mode:
            return self.runnable(*args)
        num_tokens = forward_context.batch_descriptor[0]
        entry = self.concrete_cudagraph_entries.get(forward_context.batch_descriptor)
        if entry is None:
            graph, output = capture(lambda: self.runnable(*args), device=self.device, pool=self.graph_pool,
                                    warmups=0, owner="CUDAGraphWrapper", name=f"FULL num_tokens={num_tokens}")
            self.concrete_cudagraph_entries[forward_context.batch_descriptor] = (graph, output)
            return output
        graph, output = entry
        return replay(graph, output)


class CudagraphDispatcher:
    def __init__(self, cudagraph_mode):
        # FULL_AND_PIECEWISE: FULL graphs for uniform decode batches; mixed batches go to PIECEWISE (stand-in: eager)
        self.cudagraph_keys = ({(n, True) for n in CUDAGRAPH_CAPTURE_SIZES}
                               if cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE else set())

    def dispatch(self, num_tokens, uniform_decode):
        if (num_tokens, uniform_decode) in self.cudagraph_keys:
            return CUDAGraphMode.FULL, (num_tokens, uniform_decode)
        return CUDAGraphMode.NONE, None


# --- vllm/v1/worker/kv_connector_model_runner_mixin.py and gpu_model_runner.py (reduced) ------------------------------

class KVConnectorModelRunnerMixin:
    @staticmethod
    def maybe_get_kv_connector_output(scheduler_output):
        if not has_kv_transfer_group():
            return contextlib.nullcontext()
        return KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output)

    @staticmethod
    @contextlib.contextmanager
    def _get_kv_connector_output(scheduler_output, wait_for_save=True):
        kv_connector = get_kv_transfer_group()
        assert scheduler_output.kv_connector_metadata is not None
        kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        kv_connector.start_load_kv(get_forward_context())
        try:
            yield None
        finally:
            if wait_for_save:
                kv_connector.wait_for_save()
            kv_connector.clear_connector_metadata()


class GPUModelRunner(KVConnectorModelRunnerMixin):
    def __init__(self, device, cudagraph_mode):
        self.device, self.cudagraph_mode = device, cudagraph_mode
        self.model = LlamaForCausalLM(device)
        self.no_compile_layers = {layer["attn"].layer_name: layer["attn"] for layer in self.model.layers}
        self.cudagraph_dispatcher = CudagraphDispatcher(cudagraph_mode)
        self.model_forward = CUDAGraphWrapper(self.model.forward, device)
        self.cudagraph_num_of_warmups = 1
        z = lambda *s: torch.zeros(*s, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = z(MAX_NUM_TOKENS), z(MAX_NUM_TOKENS), z(MAX_NUM_TOKENS)
        self.query_start_loc, self.seq_lens = z(MAX_NUM_REQS + 1), z(MAX_NUM_REQS)
        self.block_table = z(MAX_NUM_REQS, MAX_BLOCKS_PER_REQ)
        self.requests: dict = {}                     # req_id -> [token ids, block ids]

    def _attn_metadata(self, num_tokens, num_reqs):
        md = FlashAttentionMetadata(num_tokens, self.query_start_loc[: num_reqs + 1], self.seq_lens[:num_reqs],
                                    self.block_table[:num_reqs], self.slot_mapping[:num_tokens])
        return {name: md for name in LAYER_NAMES}

    def _dummy_run(self, num_tokens, cudagraph_runtime_mode, force_attention=False, uniform_decode=False):
        num_reqs = min(num_tokens, MAX_NUM_REQS)
        attn_metadata = None
        if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:
            # seq_lens = max_query_len (one token per request for a uniform decode batch)
            self.seq_lens[:num_reqs] = 1
            self.seq_lens[num_reqs:] = 0
            self.query_start_loc[: num_reqs + 1] = torch.arange(num_reqs + 1, device=self.device)
            self.slot_mapping[num_tokens:] = PAD_SLOT_ID
            attn_metadata = self._attn_metadata(num_tokens, num_reqs)
        batch_descriptor = (num_tokens, uniform_decode)
        with set_forward_context(attn_metadata, self.no_compile_layers, cudagraph_runtime_mode, batch_descriptor):
            return self.model_forward(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def capture_model(self):
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            return
        events.static_buffers("GPUModelRunner", {
            "input_ids": self.input_ids, "positions": self.positions, "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens, "block_table": self.block_table, "slot_mapping": self.slot_mapping})
        events.persistent_state("GPUModelRunner", {f"{n}.kv_cache": a.kv_cache[0] for n, a in
                                                   self.no_compile_layers.items()})
        # (The PIECEWISE capture of mixed batches runs with attn_metadata None: not modelled.)
        self._capture_cudagraphs(reversed(CUDAGRAPH_CAPTURE_SIZES), CUDAGraphMode.FULL, uniform_decode=True)

    def _capture_cudagraphs(self, compilation_cases, cudagraph_runtime_mode, uniform_decode):
        for num_tokens in compilation_cases:
            for _ in range(self.cudagraph_num_of_warmups):
                force_attention = cudagraph_runtime_mode == CUDAGraphMode.FULL
                with events.warmup():
                    self._dummy_run(num_tokens, CUDAGraphMode.NONE, force_attention, uniform_decode)
            self._dummy_run(num_tokens, cudagraph_runtime_mode, uniform_decode=uniform_decode)

    def _prepare_inputs(self, scheduler_output):
        for new_req in scheduler_output.scheduled_new_reqs:
            self.requests[new_req.req_id] = [list(new_req.prompt_token_ids), new_req.block_ids[0]]
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_sched = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        ids, pos, seq_lens, slots = [], [], [], []
        for r, n in zip(req_ids, num_sched):
            tokens, blocks = self.requests[r]
            start = scheduler_output.num_computed_tokens[r]
            ids += tokens[start: start + n]
            pos += list(range(start, start + n))
            seq_lens.append(start + n)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)]
        num_tokens, num_reqs = len(ids), len(req_ids)
        t = lambda x: torch.tensor(x, dtype=torch.int64).to(self.device)
        self.input_ids[:num_tokens] = t(ids)
        self.positions[:num_tokens] = t(pos)
        self.slot_mapping[:num_tokens] = t(slots)
        self.slot_mapping[num_tokens:] = PAD_SLOT_ID
        qsl = np.concatenate([[0], np.cumsum(num_sched)])
        self.query_start_loc[: num_reqs + 1] = t(qsl)
        self.query_start_loc[num_reqs + 1:] = num_tokens
        self.seq_lens[:num_reqs] = t(seq_lens)
        self.seq_lens[num_reqs:] = 0
        for i, r in enumerate(req_ids):
            self.block_table[i] = t(self.requests[r][1])
        return req_ids, num_tokens, max(num_sched), torch.from_numpy(qsl[1:] - 1).to(self.device)

    def execute_model(self, scheduler_output):
        req_ids, num_tokens, max_query_len, logits_indices = self._prepare_inputs(scheduler_output)
        num_reqs = len(req_ids)
        attn_metadata = self._attn_metadata(num_tokens, num_reqs)
        uniform_decode = max_query_len == 1 and num_tokens == num_reqs
        cudagraph_runtime_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode)
        with (set_forward_context(attn_metadata, self.no_compile_layers, cudagraph_runtime_mode, batch_descriptor),
              self.maybe_get_kv_connector_output(scheduler_output)):
            hidden_states = self.model_forward(self.input_ids[:num_tokens], self.positions[:num_tokens])
        logits = self.model.compute_logits(hidden_states[logits_indices])
        sampled = logits.argmax(dim=-1)
        for r, tok in zip(req_ids, sampled.tolist()):
            if scheduler_output.num_computed_tokens[r] + scheduler_output.num_scheduled_tokens[r] >= \
                    len(self.requests[r][0]):
                self.requests[r][0].append(tok)
        return req_ids, logits, sampled


# --- vllm/v1/core/sched (reduced): one scheduler-side connector, whole-request block allocation ----------------------

@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list
    block_ids: list


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    num_scheduled_tokens: dict
    num_computed_tokens: dict
    kv_connector_metadata: object = None


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list
    block_ids: list = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    output_token_ids: list = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, connector: SharedStorageConnector):
        self.connector, self.free_blocks = connector, list(range(1, NUM_BLOCKS))
        self.waiting, self.running = [], []

    def add_request(self, request_id, prompt_token_ids):
        self.waiting.append(Request(request_id, list(prompt_token_ids)))

    def schedule(self) -> SchedulerOutput:
        new_reqs, num_scheduled, num_computed = [], {}, {}
        for req in self.running:                             # decodes first
            num_scheduled[req.request_id], num_computed[req.request_id] = 1, req.num_computed_tokens
        for req in self.waiting:
            num_external, _ = self.connector.get_num_new_matched_tokens(req, 0)
            req.block_ids = [self.free_blocks.pop(0) for _ in range(MAX_BLOCKS_PER_REQ)]
            self.connector.update_state_after_alloc(req, req.block_ids, num_external)
            req.num_computed_tokens = num_external
            num_scheduled[req.request_id] = len(req.prompt_token_ids) - num_external
            num_computed[req.request_id] = num_external
            new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, [req.block_ids]))
        self.running += self.waiting
        self.waiting = []
        out = SchedulerOutput(new_reqs, num_scheduled, num_computed)
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def update_from_output(self, scheduler_output, req_ids, sampled):
        for req in self.running:
            req.num_computed_tokens += scheduler_output.num_scheduled_tokens[req.request_id]
            req.output_token_ids.append(int(sampled[req_ids.index(req.request_id)]))


# --- a prefill instance (kv producer), then a decode instance (kv consumer) over the same shared storage -------------

def _serve(device, use_cuda_graph, storage_prompts):
    global _kv_transfer_group
    storage, outs, first_tokens = {}, [], {}
    for role, prompts in (("kv_producer", storage_prompts), ("kv_consumer", None)):
        runner = GPUModelRunner(device, CUDAGraphMode.FULL_AND_PIECEWISE if use_cuda_graph else CUDAGraphMode.NONE)
        _kv_transfer_group = SharedStorageConnector("worker", storage)     # ensure_kv_transfer_initialized
        try:
            runner.capture_model()                                          # compile_or_warm_up_model
            scheduler = Scheduler(SharedStorageConnector("scheduler", storage))
            if prompts is None:   # the decode instance: cached prompt + the prefill instance's first token
                prompts = {r + "2": p + [first_tokens[r]] for r, p in storage_prompts.items()}
            for r, p in prompts.items():
                scheduler.add_request(r, p)
            for _ in range(3):                                              # prefill, then two decode steps
                so = scheduler.schedule()
                req_ids, logits, sampled = runner.execute_model(so)
                scheduler.update_from_output(so, req_ids, sampled)
                outs += [logits, sampled.to(DTYPE)]
            first_tokens = {req.request_id: req.output_token_ids[0] for req in scheduler.running}
        finally:
            _kv_transfer_group = None
    return outs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    gen = generator(26675)
    prompts = {"A": torch.randint(0, VOCAB, (9,), generator=gen).tolist(),
               "B": torch.randint(0, VOCAB, (6,), generator=gen).tolist()}
    with torch.no_grad():
        return compare(__name__.rsplit(".", 1)[-1], variant, device,
                       lambda: _serve(device, True, prompts), lambda: _serve(device, False, prompts))
