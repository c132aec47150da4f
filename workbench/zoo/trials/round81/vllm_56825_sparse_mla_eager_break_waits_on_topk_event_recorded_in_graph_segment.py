"""Sparse MLA index group: the indexer records ``logical_topk_ready`` inside a captured breakable-graph segment, and the attention's eager break then waits on that graph-local event, so the capture fails with "invalid argument".

Upstream: https://github.com/vllm-project/vllm/pull/56825 ("[Bugfix][SparseMLA] Fix piecewise cudagraph capture crash
in index group", JaredforReal, description dated 2026-09-14, merged, vllm-project/vllm). Issue:
https://github.com/vllm-project/vllm/issues/56785 (janbernloehr, closed).
Symptom: a plain ``vllm serve`` of GLM-5.3-Flash dies at startup. The model is a hybrid KDA + sparse-MLA model, on
``FLASHINFER_MLA_SPARSE`` with the ``DEEPSEEK_V32_INDEXER``, TP4 on GB200/GB300. vLLM logs "Auto-enabling
VLLM_USE_BREAKABLE_CUDAGRAPH=1", and then ``profile_cudagraph_memory`` -> ``cudagraph_utils.capture`` ->
``breakable_cudagraph.add_eager`` -> ``unified_mla_attention_with_output`` ->
``sparse_mla_attention._convert_logical_to_physical_topk`` -> ``index_group.convert_logical_to_physical_topk`` ->
``_convert_once``: ``self.side_stream.wait_event(self.logical_topk_ready)`` raises ``torch.AcceleratorError: CUDA
error: invalid argument``. The issue reports it on every attempt, 5 of 5 runs on two hosts, on several TP ranks.
Mechanism: in ``vllm/v1/attention/backends/mla/index_group.py``, a ``SparseMLAIndexGroup`` holds one indexer's
result for the layers that share it: the persistent ``logical_topk_indices``/``physical_topk_indices`` buffers, a
``side_stream`` and two events. The indexer writes the logical top-k and calls ``set_logical_topk_ready(0)``, which
does ``self.logical_topk_ready.record(current_stream())``. The first consuming attention layer calls
``_convert_once``, which makes the side stream ``wait_event(self.logical_topk_ready)``. On the side stream it then
runs ``triton_convert_req_index_to_global_index`` into ``physical_topk_indices`` and records
``physical_topk_ready``, which the compute stream waits on. Later layers of the group only wait. With breakable
(PIECEWISE) CUDA graphs (``vllm/compilation/breakable_cudagraph.py``), ``BreakableCUDAGraphCapture`` stream-captures
the forward. At each ``@eager_break_during_capture`` op (the MLA attention) ``add_eager`` ends the segment
(``capture_end``), runs the op eagerly, and begins a new segment. The indexer runs inside a captured segment, so the
event record becomes part of that capture. The consumer runs in the eager break after ``capture_end``, and an eager
``cudaStreamWaitEvent`` on an event whose last record was captured into a finished capture is refused with
cudaErrorInvalidValue. The issue notes that a ``torch.cuda.is_current_stream_capturing()`` guard in
``_convert_once`` does not help: it is always False there, because the segment's ``capture_end()`` has already run.
Without graphs the record and the wait are ordinary stream operations, and the outputs are right.
Doctor: sync-in-capture, at _convert_once. During the breakable capture, the eager break issues a stream wait that
crosses the capture boundary: it depends on an event that only exists as part of the segment just captured. CUDA
refuses the wait, as it refuses a host synchronisation in capture, and the capture fails. ``_convert_once`` issues
the wait, and there the fix chooses ``wait_stream`` under piecewise graphs. The fix's comment calls the skipped
record in ``set_logical_topk_ready`` a consequence ("so skip the record as well").
Fix (upstream): ``from vllm.forward_context import in_piecewise_cudagraph``. This is true when the forward context's
``cudagraph_runtime_mode`` is PIECEWISE, at capture and at replay. ``set_logical_topk_ready`` returns before the
record when ``in_piecewise_cudagraph()``. ``_convert_once`` uses
``if self.has_indexer and not in_piecewise_cudagraph(): self.side_stream.wait_event(self.logical_topk_ready)``
``else: self.side_stream.wait_stream(compute_stream)``. The eager break runs after the segment that wrote the
logical top-k, so waiting for the compute stream orders the conversion after the indexer. (Read: ``index_group.py``
before the fix, commit 7a240b6, and a later version that has the fix, commit 0332898; ``breakable_cudagraph.py``; the
PR description and the issue.)
Modelled: streams and events are Python objects on both backends, since the CPU engine does not model them. Each
stream knows the capture it is in. An event records the capture of its stream (None outside any capture). CUDA's rule
is stated in the model: a stream that is not capturing may not wait on an event whose last record was captured into
a capture that has ended. The model raises cudaErrorInvalidValue at that wait, as the PR reports. A capturing stream
may not wait on an event recorded outside its capture (cudaErrorStreamCaptureIsolation). Nothing here reaches that
rule. Execution order on streams is not modelled: every op runs in program order. ``BreakableCUDAGraphCapture`` is
written as explicit graph segments around the eager breaks (the split that ``add_eager`` makes at run time). Each
segment is one engine capture, with the modelled stream capture of the runner's capture stream inside it. Eager
breaks keep their capture-time arguments and read the live forward context, as upstream. The model is GLM-5.3-like
and cut down: 2 MLA layers in one index group. Layer 0 has the indexer: an index projection, an index-key cache
insert, and a top-4 over the request's logical token positions, with -1 past ``seq_len``. Layer 1 reuses its
result. MLA is written absorbed: one latent KV vector per token serves as key and value, and 2 query heads attend
to it. The sparse attention (the eager break) inserts the token's latent KV, converts the top-k to physical slots,
and attends over those 4 slots. The page size is 4, with 4 pages per request. The prompts' latent KV and index
keys are already in the caches, as a prefill left them (random). The runner warms up each size eagerly, then
captures it on a dummy batch that writes only the null block. There are capture sizes 2 and 4, decode only, no
padding, and 3 steps (4, 2, 4 requests). Left out: the KDA layers, the MoE, the HiSparse subclass, the prefill
path, and any use of the ``num_tokens > workspace`` fallback.
"""

import contextlib
import dataclasses
import enum
import functools

import torch

from workbench.engine import CaptureError, events, graph_pool_handle
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/vllm-project/vllm/pull/56825"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "_convert_once"
SYMPTOM = ("GLM-5.3-Flash startup with breakable PIECEWISE graphs: _convert_once's side_stream.wait_event("
           "logical_topk_ready) in the MLA eager break raises 'CUDA error: invalid argument', because the indexer "
           "recorded the event inside the captured segment")

VOCAB, HIDDEN = 32, 16
NUM_HEADS, KV_LORA_RANK = 2, 8             # absorbed MLA: 2 query heads over one latent KV vector per token
INDEX_HEAD_DIM, INDEX_TOPK = 8, 4
BLOCK_SIZE, MAX_BLOCKS_PER_REQ = 4, 4
MAX_MODEL_LEN = BLOCK_SIZE * MAX_BLOCKS_PER_REQ
MAX_NUM_REQS = 4
NUM_BLOCKS = 1 + MAX_NUM_REQS * MAX_BLOCKS_PER_REQ      # block 0: the null block dummy batches write into
NUM_LAYERS = 2
CAPTURE_SIZES = [2, 4]
VARIANT = {"v": "bug"}


# --- the modelled CUDA runtime: streams, events, stream capture --------------------------------------------------

class _Capture:
    """One stream capture (``cudaStreamBeginCapture`` ... ``cudaStreamEndCapture``)."""

    def __init__(self, origin: "Stream"):
        self.origin, self.ended = origin, False


class Stream:
    """``torch.Stream``: ``capture`` is the capture this stream takes part in, if any."""

    def __init__(self, name: str):
        self.name = name
        self.capture: _Capture | None = None

    def __repr__(self):
        return f"<Stream {self.name}>"

    def record_event(self, event: "Event") -> None:
        event.stream, event.capture = self, self.capture      # on a capturing stream: part of that capture

    def wait_event(self, event: "Event") -> None:
        """``cudaStreamWaitEvent``."""
        cap = event.capture
        if self.capture is None and cap is not None and cap.ended:
            where = user_frame()
            raise CaptureError(
                f"CUDA error: invalid argument (cudaErrorInvalidValue): {self!r}, which is not capturing, waits on "
                f"an event whose last record was captured into a graph that has ended (recorded on "
                f"{event.stream!r}); the event is graph-local.\n  at {where}",
                op="cudaStreamWaitEvent", source=where)
        if self.capture is not None and cap is not self.capture:
            where = user_frame()
            raise CaptureError(
                f"CUDA error: dependency created on uncaptured work in another stream "
                f"(cudaErrorStreamCaptureIsolation): {self!r} waits on an event outside its capture.\n  at {where}",
                op="cudaStreamWaitEvent", source=where)

    def wait_stream(self, other: "Stream") -> None:
        """``Stream.wait_stream``: record a fresh event on ``other`` and wait on it."""
        ev = Event()
        ev.record(other)
        self.wait_event(ev)


class Event:
    """``torch.Event``."""

    def __init__(self):
        self.stream: Stream | None = None
        self.capture: _Capture | None = None

    def record(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).record_event(self)


DEFAULT_STREAM = Stream("default")
_current = [DEFAULT_STREAM]


def current_stream() -> Stream:
    """``vllm.utils.torch_utils.current_stream``."""
    return _current[-1]


@contextlib.contextmanager
def use_stream(s: Stream):
    """``with stream:`` / ``torch.cuda.stream(s)``."""
    _current.append(s)
    try:
        yield
    finally:
        _current.pop()


@contextlib.contextmanager
def stream_capture(s: Stream):
    """The stream side of ``CUDAGraph.capture_begin()`` ... ``capture_end()`` on the current stream ``s``."""
    cap = _Capture(s)
    s.capture = cap
    try:
        yield
    finally:
        s.capture = None
        cap.ended = True


# --- vllm/forward_context.py --------------------------------------------------------------------------------------

class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: object
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE


_forward_context: list[ForwardContext | None] = [None]


def get_forward_context() -> ForwardContext:
    assert _forward_context[0] is not None, "Forward context is not set."
    return _forward_context[0]


def is_forward_context_available() -> bool:
    return _forward_context[0] is not None


@contextlib.contextmanager
def set_forward_context(attn_metadata, cudagraph_runtime_mode=CUDAGraphMode.NONE):
    prev, _forward_context[0] = _forward_context[0], ForwardContext(attn_metadata, cudagraph_runtime_mode)
    try:
        yield
    finally:
        _forward_context[0] = prev


def in_piecewise_cudagraph() -> bool:
    """Whether the current forward runs in piecewise cudagraph mode (graph segments separated by eager breaks), at
    capture or replay time."""
    return (is_forward_context_available()
            and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE)


# --- vllm/compilation/breakable_cudagraph.py ----------------------------------------------------------------------

class BreakableCUDAGraphCapture:
    """Captures a forward as CUDA-graph segments split at each ``@eager_break_during_capture`` call. The break
    ends the segment (``capture_end``), runs eagerly, is recorded for replay with its capture-time arguments, and
    a new segment begins."""

    _current: list = [None]

    def __init__(self, device, pool, name, static, state):
        self.device, self.pool, self.name, self.static, self.state = device, pool, name, static, state
        self.segments: list[tuple] = []

    @classmethod
    def current(cls):
        return cls._current[0]

    def __enter__(self):
        self._current[0] = self
        return self

    def __exit__(self, *exc):
        self._current[0] = None
        return False

    def graph_segment(self, fn):
        stream = current_stream()

        def captured():
            with stream_capture(stream):                 # g.capture_begin() ... g.capture_end()
                return fn()

        g, out = capture(captured, device=self.device, pool=self.pool, warmups=0,
                         name=f"{self.name} segment {self.num_graphs}", static=self.static, state=self.state,
                         owner="BreakableCUDAGraphCapture")
        self.segments.append(("graph", g, out))
        return out

    def add_eager(self, fn):
        """End the current capture segment, run ``fn`` eagerly on the capture stream, record it for replay."""
        with events.dummy_run():
            result = fn()
        self.segments.append(("eager", fn, None))
        return result

    def replay(self):
        result = None
        for kind, a, b in self.segments:
            if kind == "eager":
                a()
            else:
                result = replay(a, b)
        return result

    @property
    def num_graphs(self):
        return sum(kind == "graph" for kind, _, _ in self.segments)

    @property
    def num_eager_breaks(self):
        return sum(kind == "eager" for kind, _, _ in self.segments)


def eager_break_during_capture(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        capture_ = BreakableCUDAGraphCapture.current()
        if capture_ is None:
            return fn(*args)
        return capture_.add_eager(lambda: fn(*args))
    return wrapper


def graph_segment(fn):
    """The code between two eager breaks: one captured graph in a breakable capture, plain code otherwise."""
    capture_ = BreakableCUDAGraphCapture.current()
    return fn() if capture_ is None else capture_.graph_segment(fn)


# --- vllm/v1/attention/backends/mla/sparse_utils.py ---------------------------------------------------------------

def triton_convert_req_index_to_global_index(req_id_per_token, block_table, token_indices, *, BLOCK_SIZE,
                                             NUM_TOPK_TOKENS, BLOCK_STRIDE_ROWS=None, return_valid_counts=False,
                                             out=None, valid_counts_out=None):
    """Logical token index within its request -> physical KV slot (``-1`` stays ``-1``)."""
    assert token_indices.shape[1] == NUM_TOPK_TOKENS
    valid = token_indices >= 0
    idx = token_indices.clamp_min(0).long()
    rows = block_table[req_id_per_token.long()].long()                    # [T, max_blocks]
    blocks = torch.gather(rows, 1, idx // BLOCK_SIZE)
    physical = torch.where(valid, blocks * BLOCK_SIZE + idx % BLOCK_SIZE, -1).to(token_indices.dtype)
    counts = valid.sum(-1).to(torch.int32)
    if out is None:
        out = physical
    else:
        out.copy_(physical)
    if valid_counts_out is not None:
        valid_counts_out.copy_(counts)
    if return_valid_counts:
        return out, counts if valid_counts_out is None else valid_counts_out
    return out


# --- vllm/v1/attention/backends/mla/index_group.py ----------------------------------------------------------------

@dataclasses.dataclass
class SparseMLAIndexGroup:
    """Layers that consume one sparse-indexer result."""

    logical_topk_indices: torch.Tensor
    physical_topk_indices: torch.Tensor
    valid_topk_counts: torch.Tensor
    side_stream: Stream
    logical_topk_ready: Event
    physical_topk_ready: Event
    has_indexer: bool
    num_layers: int = 0

    def register_layer(self) -> int:
        layer_index = self.num_layers
        self.num_layers += 1
        return layer_index

    def set_logical_topk_ready(self, layer_index: int) -> None:
        if VARIANT["v"] == "bug":
            if layer_index == 0 and self.has_indexer:
                self.logical_topk_ready.record(current_stream())
            return
        if layer_index != 0 or not self.has_indexer:
            return
        # In piecewise cudagraph mode the consumer converts on the side stream from an eager break; an event
        # recorded inside a captured segment is graph-local, so skip the record (the convert side waits on the
        # compute stream instead).
        if in_piecewise_cudagraph():
            return
        self.logical_topk_ready.record(current_stream())

    def convert_logical_to_physical_topk(self, layer_index, logical_topk_indices, attn_metadata, *,
                                         block_stride_rows, return_valid_counts):
        """Convert one index result once for all layers in this group."""
        return self._convert_once(
            layer_index, logical_topk_indices,
            attn_metadata.req_id_per_token[: logical_topk_indices.shape[0]],
            attn_metadata.block_table, attn_metadata.block_size,
            block_stride_rows=block_stride_rows, return_valid_counts=return_valid_counts)

    def _convert_once(self, layer_index, logical_topk_indices, req_id_per_token, block_table, block_size, *,
                      block_stride_rows, return_valid_counts):
        num_tokens = logical_topk_indices.shape[0]
        if num_tokens > self.physical_topk_indices.shape[0]:
            return triton_convert_req_index_to_global_index(
                req_id_per_token, block_table, logical_topk_indices, BLOCK_SIZE=block_size,
                BLOCK_STRIDE_ROWS=block_stride_rows, NUM_TOPK_TOKENS=logical_topk_indices.shape[1],
                return_valid_counts=return_valid_counts)

        physical_topk_indices = self.physical_topk_indices[:num_tokens]
        valid_topk_counts = self.valid_topk_counts[:num_tokens]
        compute_stream = current_stream()
        if layer_index == 0:
            # (torch.cuda.is_current_stream_capturing() is False here even during the breakable capture: the
            # eager break runs after the segment's capture_end().)
            if VARIANT["v"] == "bug":
                if self.has_indexer:
                    self.side_stream.wait_event(self.logical_topk_ready)
                else:
                    self.side_stream.wait_stream(compute_stream)
            elif self.has_indexer and not in_piecewise_cudagraph():
                self.side_stream.wait_event(self.logical_topk_ready)
            else:
                self.side_stream.wait_stream(compute_stream)
            with use_stream(self.side_stream):
                triton_convert_req_index_to_global_index(
                    req_id_per_token, block_table, logical_topk_indices, BLOCK_SIZE=block_size,
                    BLOCK_STRIDE_ROWS=block_stride_rows, NUM_TOPK_TOKENS=logical_topk_indices.shape[1],
                    return_valid_counts=return_valid_counts, out=physical_topk_indices,
                    valid_counts_out=valid_topk_counts if return_valid_counts else None)
                self.physical_topk_ready.record(self.side_stream)
        compute_stream.wait_event(self.physical_topk_ready)

        if return_valid_counts:
            return physical_topk_indices, valid_topk_counts
        return physical_topk_indices


class SparseMLAIndexGroupBuilder:
    """Assign sparse MLA layers to their index-producing layer."""

    def __init__(self, logical_topk_indices: torch.Tensor, max_decode_rows: int):
        self.logical_topk_indices, self.max_decode_rows = logical_topk_indices, max_decode_rows
        self.current_group: SparseMLAIndexGroup | None = None

    def register_layer(self, is_index_producing_layer: bool):
        if is_index_producing_layer or self.current_group is None:
            t = self.logical_topk_indices
            self.current_group = SparseMLAIndexGroup(
                logical_topk_indices=t,
                physical_topk_indices=torch.empty((self.max_decode_rows + 1, t.shape[1]), dtype=t.dtype,
                                                  device=t.device),
                valid_topk_counts=torch.empty(self.max_decode_rows + 1, dtype=torch.int32, device=t.device),
                side_stream=Stream("index group side stream"),
                logical_topk_ready=Event(), physical_topk_ready=Event(),
                has_indexer=is_index_producing_layer)
        return self.current_group, self.current_group.register_layer()


# --- the attention metadata (persistent runner buffers) -----------------------------------------------------------

@dataclasses.dataclass
class SparseMLAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    block_size: int = BLOCK_SIZE


# --- the model: vllm/model_executor/models/deepseek_v2.py + layers/attention/{mla,sparse_mla}_attention.py ----------

def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Indexer:
    """The DeepSeek-V3.2 lightning indexer (in the captured segment): index-key insert, then the top-k logical
    token positions of each token's request."""

    def __init__(self, gen, device, index_group: SparseMLAIndexGroup, layer_index: int):
        self.wq = randn(HIDDEN, INDEX_HEAD_DIM, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.wk = randn(HIDDEN, INDEX_HEAD_DIM, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, INDEX_HEAD_DIM, device=device)
        self.index_group, self.layer_index = index_group, layer_index

    def forward(self, hidden_states):
        md = get_forward_context().attn_metadata
        n = hidden_states.shape[0]
        q, k = hidden_states @ self.wq, hidden_states @ self.wk
        self.k_cache.view(-1, INDEX_HEAD_DIM)[md.slot_mapping[:n]] = k
        pos = torch.arange(MAX_MODEL_LEN, device=q.device)
        table = md.block_table[md.req_id_per_token[:n].long()].long()                       # [n, max_blocks]
        slots = torch.gather(table, 1, (pos // BLOCK_SIZE)[None].expand(n, -1)) * BLOCK_SIZE + pos % BLOCK_SIZE
        keys = self.k_cache.view(-1, INDEX_HEAD_DIM)[slots]                                  # [n, L, I]
        scores = torch.einsum("ni,nli->nl", q, keys)
        scores = scores.masked_fill(pos[None] >= md.seq_lens[:n, None].long(), float("-inf"))
        vals, idx = torch.topk(scores, INDEX_TOPK, dim=-1)
        topk = self.index_group.logical_topk_indices[:n]
        topk.copy_(torch.where(vals > float("-inf"), idx, -1).to(topk.dtype))
        self.index_group.set_logical_topk_ready(self.layer_index)


class SparseMLAAttention:
    def __init__(self, gen, device, layer_name, index_group, layer_index):
        self.layer_name = layer_name
        self.kv_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_LORA_RANK, device=device)
        self.index_group, self.layer_index = index_group, layer_index
        self.scale = KV_LORA_RANK ** -0.5

    def _convert_logical_to_physical_topk(self, attn_metadata):
        n = attn_metadata.num_actual_tokens
        return self.index_group.convert_logical_to_physical_topk(
            self.layer_index, self.index_group.logical_topk_indices[:n], attn_metadata,
            block_stride_rows=None, return_valid_counts=False)

    def forward_impl(self, q, kv_latent, output):
        md = get_forward_context().attn_metadata
        n = md.num_actual_tokens
        self.kv_cache.view(-1, KV_LORA_RANK)[md.slot_mapping[:n]] = kv_latent[:n]      # concat_and_cache_mla
        physical = self._convert_logical_to_physical_topk(md)                           # [n, K]
        kv = self.kv_cache.view(-1, KV_LORA_RANK)[physical.clamp_min(0).long()]         # [n, K, D]
        scores = torch.einsum("nhd,nkd->nhk", q[:n], kv) * self.scale
        scores = scores.masked_fill((physical < 0)[:, None, :], float("-inf"))
        output[:n].copy_(torch.einsum("nhk,nkd->nhd", torch.softmax(scores, -1), kv))


_layers: dict[str, SparseMLAAttention] = {}          # the compilation config's static_forward_context


@eager_break_during_capture
def unified_mla_attention_with_output(q, kv_latent, output, layer_name):
    """``torch.ops.vllm.unified_mla_attention_with_output``: writes ``output`` in place."""
    _layers[layer_name].forward_impl(q, kv_latent, output)
    return output


class DeepseekV32DecoderLayer:
    def __init__(self, gen, device, i, builder: SparseMLAIndexGroupBuilder):
        has_indexer = i == 0                         # index_topk_freq: later layers reuse the group's top-k
        group, layer_index = builder.register_layer(has_indexer)
        self.wq = randn(HIDDEN, NUM_HEADS * KV_LORA_RANK, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.wkv = randn(HIDDEN, KV_LORA_RANK, gen=gen, device=device, scale=HIDDEN ** -0.5)
        self.wo = randn(NUM_HEADS * KV_LORA_RANK, HIDDEN, gen=gen, device=device,
                        scale=(NUM_HEADS * KV_LORA_RANK) ** -0.5)
        self.indexer = Indexer(gen, device, group, layer_index) if has_indexer else None
        self.attn = SparseMLAAttention(gen, device, f"model.layers.{i}.self_attn.attn", group, layer_index)
        _layers[self.attn.layer_name] = self.attn

    def pre_attention(self, hidden_states):
        h = _rms(hidden_states)
        q = (h @ self.wq).view(-1, NUM_HEADS, KV_LORA_RANK)
        kv_latent = _rms(h @ self.wkv)
        if self.indexer is not None:
            self.indexer.forward(h)
        return q, kv_latent, torch.empty_like(q)

    def post_attention(self, hidden_states, attn_output):
        return hidden_states + attn_output.reshape(hidden_states.shape[0], -1) @ self.wo


class GlmMoeDsaForCausalLM:
    def __init__(self, device):
        gen = generator(56825)
        self.logical_topk_indices = torch.full((MAX_NUM_REQS, INDEX_TOPK), -1, dtype=torch.int32, device=device)
        builder = SparseMLAIndexGroupBuilder(self.logical_topk_indices, max_decode_rows=MAX_NUM_REQS)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device)
        self.layers = [DeepseekV32DecoderLayer(gen, device, i, builder) for i in range(NUM_LAYERS)]
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=HIDDEN ** -0.5)

    def forward(self, input_ids):
        """Written as the breakable capture splits it: a graph segment up to each MLA attention's eager break, the
        break, and a last segment (the final norm and the logits)."""
        hidden = attn_output = None
        for layer, prev in zip(self.layers, [None] + self.layers[:-1]):
            def before_break(layer=layer, prev=prev, hidden=hidden, attn_output=attn_output):
                h = self.embed_tokens[input_ids] if prev is None else prev.post_attention(hidden, attn_output)
                return (h,) + layer.pre_attention(h)

            hidden, q, kv_latent, output = graph_segment(before_break)
            attn_output = unified_mla_attention_with_output(q, kv_latent, output, layer.attn.layer_name)
        last = self.layers[-1]
        return graph_segment(lambda: _rms(last.post_attention(hidden, attn_output)) @ self.lm_head)


# --- vllm/v1/worker/gpu/{model_runner,cudagraph_utils}.py ---------------------------------------------------------

class GPUModelRunner:
    def __init__(self, device, enforce_eager):
        self.device, self.enforce_eager = device, enforce_eager
        self.model = GlmMoeDsaForCausalLM(device)
        n = MAX_NUM_REQS
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, MAX_BLOCKS_PER_REQ, dtype=torch.int32, device=device)
        self.req_id_per_token = torch.zeros(n, dtype=torch.int32, device=device)
        self.req_blocks: list[list[int]] = []
        self.capture_stream = Stream("graph capture stream")
        self.cudagraphs: dict[int, BreakableCUDAGraphCapture] = {}

    def _metadata(self, n):
        return SparseMLAMetadata(n, self.slot_mapping[:n], self.seq_lens[:n], self.block_table[:n],
                                 self.req_id_per_token[:n])

    def _state(self):
        state = {}
        for i, layer in enumerate(self.model.layers):
            state[f"layers.{i}.kv_cache"] = layer.attn.kv_cache
            if layer.indexer is not None:
                state[f"layers.{i}.indexer.k_cache"] = layer.indexer.k_cache
        return state

    def _prepare_inputs_to_capture(self, n):
        """The capture's dummy batch: one token per request, every write into the null block."""
        self.input_ids[:n] = 0
        self.slot_mapping[:n] = torch.arange(n, device=self.device) % BLOCK_SIZE
        self.seq_lens[:n] = 1
        self.block_table[:n] = 0
        self.req_id_per_token[:n] = torch.arange(n, dtype=torch.int32, device=self.device)

    def capture_model(self):
        pool = graph_pool_handle(self.device)
        static = {"input_ids": self.input_ids, "slot_mapping": self.slot_mapping, "seq_lens": self.seq_lens,
                  "block_table": self.block_table, "req_id_per_token": self.req_id_per_token}
        with use_stream(self.capture_stream):
            for n in reversed(CAPTURE_SIZES):
                self._prepare_inputs_to_capture(n)
                with events.warmup(), set_forward_context(self._metadata(n)):
                    self.model.forward(self.input_ids[:n])
                cap = BreakableCUDAGraphCapture(self.device, pool, f"breakable num_tokens={n}", static, self._state())
                with set_forward_context(self._metadata(n), CUDAGraphMode.PIECEWISE), cap:
                    self.model.forward(self.input_ids[:n])
                assert cap.num_graphs == NUM_LAYERS + 1 and cap.num_eager_breaks == NUM_LAYERS
                self.cudagraphs[n] = cap

    def load_prompts(self, prompt_lens, gen):
        """What the prefill left: each request's latent KV and index keys in its pages."""
        for r, length in enumerate(prompt_lens):
            blocks = [1 + r * MAX_BLOCKS_PER_REQ + b for b in range(MAX_BLOCKS_PER_REQ)]
            self.req_blocks.append(blocks)
            pos = torch.arange(length)
            slots = (torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(self.device)
            for layer in self.model.layers:
                layer.attn.kv_cache.view(-1, KV_LORA_RANK)[slots] = randn(length, KV_LORA_RANK, gen=gen,
                                                                          device=self.device)
                if layer.indexer is not None:
                    layer.indexer.k_cache.view(-1, INDEX_HEAD_DIM)[slots] = randn(length, INDEX_HEAD_DIM, gen=gen,
                                                                                  device=self.device)

    def execute_model(self, rows, token_ids, positions):
        n = len(rows)
        self.input_ids[:n] = torch.tensor(token_ids, device=self.device)
        self.seq_lens[:n] = torch.tensor(positions, dtype=torch.int32, device=self.device) + 1
        self.block_table[:n] = torch.tensor([self.req_blocks[r] for r in rows], dtype=torch.int32,
                                            device=self.device)
        self.slot_mapping[:n] = torch.tensor([self.req_blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                              for r, p in zip(rows, positions)], device=self.device)
        self.req_id_per_token[:n] = torch.arange(n, dtype=torch.int32, device=self.device)
        if self.enforce_eager or n not in self.cudagraphs:
            with set_forward_context(self._metadata(n)):
                return self.model.forward(self.input_ids[:n]).clone()
        with set_forward_context(self._metadata(n), CUDAGraphMode.PIECEWISE):
            return self.cudagraphs[n].replay().clone()


def run(variant: str, device: str = "cpu"):
    VARIANT["v"] = variant
    prompt_lens = [5, 9, 3, 7]
    gen = generator(1)
    schedule = [[0, 1, 2, 3], [1, 3], [0, 1, 2, 3]]
    steps, lengths = [], list(prompt_lens)
    for rows in schedule:
        steps.append((rows, torch.randint(0, VOCAB, (len(rows),), generator=gen).tolist(), [lengths[r] for r in rows]))
        for r in rows:
            lengths[r] += 1

    def serve(enforce_eager):
        _layers.clear()
        runner = GPUModelRunner(device, enforce_eager)
        if not enforce_eager:
            runner.capture_model()
        runner.load_prompts(prompt_lens, generator(2))
        return [runner.execute_model(rows, ids, pos) for rows, ids, pos in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(False), lambda: serve(True))
