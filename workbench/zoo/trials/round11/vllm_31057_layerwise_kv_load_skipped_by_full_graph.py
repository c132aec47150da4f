"""A FULL decode graph replays attention without the connector's ``wait_for_layer_load``: it reads unloaded KV.

Upstream: https://github.com/vllm-project/vllm/pull/31057 ("[KVConnector] Auto-downgrade to PIECEWISE
cudagraph mode for layerwise async ops"), fixing https://github.com/vllm-project/vllm/issues/29608
("CUDA Graph Replay Skips KV Transfer Synchronization in Full Cache Hit Scenarios").
Symptom: with a layer-wise asynchronous KV connector (LMCache ``use_layerwise=True``) and a FULL CUDA-graph
mode (FULL, FULL_AND_PIECEWISE, FULL_DECODE_ONLY), requests whose prompt is a full external cache hit answer
from KV that has not finished loading (silently wrong first tokens); ``--enforce-eager`` or PIECEWISE graphs
are fine (vLLM V1, Nov 2025).
Mechanism: on a full cache hit the connector reserves one prompt token for the scheduler, so the step is a
one-token-per-request uniform decode batch and the dispatcher picks the FULL graph. ``start_load_kv`` (eager,
before the forward) only starts the per-layer transfers; ``unified_attention`` calls
``wait_for_kv_layer_from_connector`` before it reads the paged cache, and that host call is what blocks until
the layer's KV has landed. Inside a FULL graph that call ran once, at capture, when nothing was in flight,
and recorded no work; a replay re-issues only the kernels, so attention reads the cache slots before the
transfer has written them (here: zeros). The transfer lands after the step, too late.
Doctor: host-work-frozen, at ``wait_for_kv_layer_from_connector`` (host synchronisation inside the captured
region ran once at capture and is skipped by every replay).
Fix (upstream): ``KVConnectorBase_V1.requires_piecewise_for_cudagraph`` (True for LMCache with
``use_layerwise``); ``VllmConfig.__post_init__`` downgrades ``cudagraph_mode`` to PIECEWISE for such
connectors, so attention and its connector hooks run eagerly between the graph pieces at every step.
"""
from __future__ import annotations

import dataclasses

import torch

from workbench.engine import CUDAGraphMode, GraphManager, events
from workbench.zoo.kit import compare, generator, randn

UPSTREAM = "https://github.com/vllm-project/vllm/pull/31057"
FAMILY = "warmup/capture vs replay state"
KIND = "host-work-frozen"
SITE = "wait_for_kv_layer_from_connector"
SYMPTOM = "full external cache hits decode from KV the FULL graph never waited for (wrong first tokens)"

VOCAB, DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, NUM_LAYERS = 12, 4, 2, 10, 4, 2
MAX_CTX = MAX_BLOCKS * BLOCK_SIZE
CAPTURE_SIZES = [1, 2]
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass
class VllmConfig:
    cudagraph_mode: CUDAGraphMode
    kv_transfer_config: dict | None
    fixed: bool = True

    def __post_init__(self):
        if self.kv_transfer_config is None or not self.fixed:
            return
        connector_cls = LMCacheConnectorV1                      # KVConnectorFactory.get_connector_class
        extra_config = self.kv_transfer_config.get("kv_connector_extra_config", {})
        if (connector_cls.requires_piecewise_for_cudagraph(extra_config)
                and self.cudagraph_mode is CUDAGraphMode.FULL):
            # Layer-wise async KV ops run as Python around attention: FULL graphs would skip them.
            self.cudagraph_mode = CUDAGraphMode.PIECEWISE


# ----------------------------------------------------------------------------- connector
class LMCacheConnectorV1:
    """A layer-wise asynchronous connector: loads start before the forward and each layer waits for its own."""

    def __init__(self, kv_caches: dict, external_store: dict, extra_config: dict):
        self.kv_caches = kv_caches
        self.external_store = external_store           # req_id -> per-layer (key, value) of its prompt prefix
        self.use_layerwise = extra_config.get("use_layerwise", False)
        self._connector_metadata = None
        self.layerwise_retrievers: dict[str, list] = {}   # layer -> transfers in flight

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        return bool(extra_config.get("use_layerwise", False))

    def bind_connector_metadata(self, metadata):
        self._connector_metadata = metadata

    def start_load_kv(self, forward_context):
        """Issue the retrievals on the transfer stream (they land when someone waits for them)."""
        for req_id, slots in self._connector_metadata["loads"]:
            for i, layer_name in enumerate(LAYER_NAMES):
                key, value = self.external_store[req_id][i]
                self.layerwise_retrievers.setdefault(layer_name, []).append((slots, key, value))

    def _land(self, layer_name):
        key_cache, value_cache = self.kv_caches[layer_name]
        for slots, key, value in self.layerwise_retrievers.pop(layer_name, []):
            key_cache[slots] = key
            value_cache[slots] = value

    def wait_for_layer_load(self, layer_name: str):
        self._land(layer_name)                           # blocks until this layer's transfer has landed

    def clear_connector_metadata(self):
        # The transfer stream completes on its own after the step (too late for a step that did not wait).
        for layer_name in list(self.layerwise_retrievers):
            self._land(layer_name)
        self._connector_metadata = None


_kv_transfer_group: LMCacheConnectorV1 | None = None


def has_kv_transfer_group() -> bool:
    return _kv_transfer_group is not None


def get_kv_transfer_group() -> LMCacheConnectorV1:
    return _kv_transfer_group


# ----------------------------------------------------------------------------- forward context / attention
@dataclasses.dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    seq_lens: torch.Tensor           # views of the runner's persistent buffers
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class ForwardContext:
    attn_metadata: dict | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


def wait_for_kv_layer_from_connector(layer_name: str):
    if not has_kv_transfer_group():
        return
    connector = get_kv_transfer_group()
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    assert isinstance(attn_metadata, dict)
    connector.wait_for_layer_load(layer_name)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping):
    key_cache[slot_mapping] = key
    value_cache[slot_mapping] = value


def flash_attn_varlen_func(q, key_cache, value_cache, block_table, seq_lens):
    """Decode attention: one query per request over its first ``seq_lens`` cached tokens."""
    ctx = torch.arange(MAX_CTX, device=q.device)
    slots = block_table[:, ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE
    k, v = key_cache[slots], value_cache[slots]
    scores = (q[:, None, :] * k).sum(-1) / DIM ** 0.5
    scores = scores.masked_fill(ctx[None, :] >= seq_lens[:, None], float("-inf"))
    return (torch.softmax(scores, -1)[..., None] * v).sum(1)


def unified_attention(query, key, value, layer_name: str, kv_caches):
    wait_for_kv_layer_from_connector(layer_name)
    attn_metadata = get_forward_context().attn_metadata[layer_name]
    key_cache, value_cache = kv_caches[layer_name]
    n = attn_metadata.num_actual_tokens
    reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping[:n])
    return flash_attn_varlen_func(query, key_cache, value_cache, attn_metadata.block_table[:n],
                                  attn_metadata.seq_lens[:n])


# ----------------------------------------------------------------------------- runner
class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device, enforce_eager: bool):
        gen = generator(31057)
        self.device = device
        self.emb = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = [tuple(randn(DIM, DIM, gen=gen, device=device, scale=0.5) for _ in range(4))
                       for _ in LAYER_NAMES]
        self.kv_caches = {name: (torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device),
                                 torch.zeros(NUM_BLOCKS * BLOCK_SIZE, DIM, device=device)) for name in LAYER_NAMES}
        n = max(CAPTURE_SIZES)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.block_table = torch.zeros(n, MAX_BLOCKS, dtype=torch.long, device=device)
        mode = CUDAGraphMode.NONE if enforce_eager else vllm_config.cudagraph_mode
        self.manager = GraphManager(self._model_forward, CAPTURE_SIZES, device=device, mode=mode,
                                    static_buffers={"input_ids": self.input_ids, "seq_lens": self.seq_lens,
                                                    "slot_mapping": self.slot_mapping,
                                                    "block_table": self.block_table},
                                    name="GPUModelRunner")
        self.unified_attention = self.manager.eager(unified_attention)      # the splitting op

    def forward(self, num_tokens: int):
        h = self.emb[self.input_ids[:num_tokens]]
        for (wq, wk, wv, wo), layer_name in zip(self.layers, LAYER_NAMES):
            attn = self.unified_attention(h @ wq, h @ wk, h @ wv, layer_name, self.kv_caches)
            h = h + attn @ wo
        return h

    def _model_forward(self, num_tokens: int):
        if _forward_context.attn_metadata is not None:
            return self.forward(num_tokens)
        # _dummy_run(num_tokens) at capture: dummy metadata for a uniform decode batch, no connector work bound.
        _forward_context.attn_metadata = self._attn_metadata(num_tokens)
        try:
            return self.forward(num_tokens)
        finally:
            _forward_context.attn_metadata = None

    def _attn_metadata(self, num_tokens):
        md = FlashAttentionMetadata(num_tokens, self.seq_lens, self.block_table, self.slot_mapping)
        return {name: md for name in LAYER_NAMES}

    def capture_model(self):
        events.persistent_state("GPUModelRunner", {f"{name}.{kv}": t for name, pair in self.kv_caches.items()
                                                   for kv, t in zip(("key_cache", "value_cache"), pair)})
        self.seq_lens.fill_(1)                          # dummy requests of one token on block 0
        self.manager.capture()
        for key_cache, value_cache in self.kv_caches.values():
            key_cache.zero_()
            value_cache.zero_()

    def execute_model(self, scheduled, connector_metadata):
        """``scheduled``: (token, position, blocks) per request, one token each (uniform decode)."""
        n = len(scheduled)
        for i, (tok, pos, blocks) in enumerate(scheduled):
            self.input_ids[i] = tok
            self.seq_lens[i] = pos + 1
            self.block_table[i].zero_()
            self.block_table[i, :len(blocks)] = torch.tensor(blocks, device=self.device)
            self.slot_mapping[i] = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        connector = get_kv_transfer_group()
        connector.bind_connector_metadata(connector_metadata)
        _forward_context.attn_metadata = self._attn_metadata(n)
        try:
            connector.start_load_kv(_forward_context)                 # maybe_setup_kv_connector
            size = self.manager.dispatch(n)
            if size is None:
                out = self.manager.run_eager(n)[:n].clone()
            else:
                out = self.manager.replay(size, n).clone()
        finally:
            _forward_context.attn_metadata = None
            connector.clear_connector_metadata()
        return out


def _slots(blocks, num_tokens):
    return torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)])


def run(variant: str, device: str = "cpu"):
    global _kv_transfer_group
    gen = generator(29608)
    # What the prefill instance stored for each prompt prefix (per layer key and value).
    external_store = {req: [(randn(3, DIM, gen=gen, device=device), randn(3, DIM, gen=gen, device=device))
                            for _ in LAYER_NAMES] for req in ("A", "B")}
    blocks = {"A": [1, 2, 3], "B": [4, 5, 6]}
    kv_transfer_config = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"use_layerwise": True}}

    def serve(enforce_eager: bool):
        global _kv_transfer_group
        config = VllmConfig(CUDAGraphMode.FULL, kv_transfer_config, fixed=(variant == "fix"))
        runner = GPUModelRunner(config, device, enforce_eager)
        _kv_transfer_group = LMCacheConnectorV1(runner.kv_caches, external_store,
                                                kv_transfer_config["kv_connector_extra_config"])
        runner.capture_model()
        outs = []
        # A: 4-token prompt, full external hit: 3 tokens loaded, the last prompt token scheduled (position 3).
        loads_a = [("A", _slots(blocks["A"], 3).to(device))]
        outs.append(runner.execute_model([(7, 3, blocks["A"])], {"loads": loads_a}))
        # A decodes while B arrives with a full external hit too: a uniform decode batch of 2.
        loads_b = [("B", _slots(blocks["B"], 3).to(device))]
        outs.append(runner.execute_model([(5, 4, blocks["A"]), (9, 3, blocks["B"])], {"loads": loads_b}))
        outs.append(runner.execute_model([(2, 5, blocks["A"]), (4, 4, blocks["B"])], {"loads": []}))
        return outs

    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
    finally:
        _kv_transfer_group = None
