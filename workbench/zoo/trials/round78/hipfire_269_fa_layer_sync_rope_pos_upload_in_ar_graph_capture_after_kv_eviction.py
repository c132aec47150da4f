"""After TriAttention evicts KV rows, the next AR-decode hipGraph capture runs the FA layers' synchronous ``hipMemcpy`` of the compacted RoPE position, which the capturing stream refuses (HipError 906): the daemon panics.

Upstream: https://github.com/warpfront/hipfire/pull/269 ("fix(qwen35): guard hipGraph capture against TriAttention
eviction stream conflict", opened 2026-05-16, merged as cb8d4dac; commits 7790ac6a and 59e94596). It fixes issue #246,
"Panic during hipGraph capture when `kv_cache.compact_offset > 0` (HipError 906)".
Symptom: the daemon panics on a decode step once a long prompt has made TriAttention/CASK compact the KV cache:
``HipError { code: 906, message: "hipMemcpy H2D: operation would make the legacy stream depend on a capturing
blocking stream" }``. The error surfaces at the daemon's ``forward_scratch(..).unwrap()``. With hipGraph off
(``HIPFIRE_GRAPH=0``; it is on by default on gfx11/gfx12) decode is clean.
Mechanism: ``qwen35::forward_scratch`` (``crates/engine/src/qwen35.rs``, later ``crates/hipfire-arch-qwen35``) runs
the single-token AR decode forward. The first call with graphs on runs direct as a warmup (``ar_forward_warmed_up``),
so JIT and lazy ``hipMalloc`` happen outside any capture. The next call writes ``scratch.pos_buf`` from the host,
opens a hipGraph capture (``begin_graph_capture`` sets ``gpu.capture_mode``), records ``forward_scratch_layers``,
then instantiates and launches the graph. Later calls replay it after a ``stream_write_value32`` of the new position
into ``pos_buf``. The graph is position-agnostic: RoPE, ``kv_cache_write`` and flash attention read ``pos_buf`` on the
device. TriAttention eviction (``maybe_evict``, after the chunked prefill and after every decode token) compacts the
cache to ``budget`` rows and adds the dropped count to ``kv_cache.compact_offset``. From then on ``pos`` is the
physical write slot, and RoPE needs the absolute phase ``pos + compact_offset``. So every FA layer of
``forward_scratch_layers`` does this: if ``kv_cache.compact_offset > 0``, ``gpu.hip.memcpy_htod(&s.pos_buf,
&abs.to_ne_bytes())``; then it runs ``rope_partial_interleaved_f32``; then it copies the physical ``pos`` back for
the KV write and attention. ``memcpy_htod`` is a synchronous ``hipMemcpy`` on the legacy stream. Direct execution
allows it. Inside the capture it is a host synchronisation against the capturing stream, so HIP refuses it with
error 906, and the capture is lost. A long prompt evicts during prefill, so the first capture after it fails.
Here that is the second decode token, since the first is the direct warmup. (This is the pre-fix structure of
the April 2026 snapshot: warmup, one capture, then replays fed by ``stream_write_value32``. It is the replay path
the PR describes.)
Doctor: sync-in-capture, at forward_scratch_layers. A host synchronisation (the blocking H2D copy of the compacted
position) is attempted while the AR-decode capture is open. It lives in the FA-layer block of
``forward_scratch_layers``, which the fix changed (the 11 ``memcpy_htod`` sites became ``memcpy_htod_auto``). It is
reached only because ``forward_scratch`` opens a capture while ``compact_offset > 0``.
Fix (upstream): 7790ac6a adds ``Gpu::memcpy_htod_auto`` (``crates/rdna-compute/src/dispatch.rs``). When
``capture_mode`` is set, it issues ``memcpy_htod_async`` on the active (capturing) stream, and otherwise the sync
copy. All 11 compact-offset ``pos_buf`` uploads in qwen35 use it. But a captured H2D copy would replay the
capture-time ``pos + offset`` over every fresh ``pos_buf`` (the PR's "part 2": garbled output, no error). So
59e94596 also keeps the AR graph off, for both capture and replay, while ``compact_offset > 0``: those steps run
direct. Later this became ``ar_graph_eligible_for_kv(requested, compact_offset) = requested && compact_offset ==
0``; #565 extended it to the retained-replay route. The model keeps both parts. In this workload only the gate is
exercised, because no capture opens while the offset is non-zero.
Modelled: a Qwen3.5 reduced to 2 full-attention layers. The 3 DeltaNet layers per FA layer, the output gate's
rmsnorms, the FFN and MoE are left out; quantised KV and GEMV are f32 matmuls. The embedding writes ``scratch.x``
outside the graph. The graph copies it into its own residual ``scratch.h`` instead of adding into ``x`` in place.
RoPE is interleaved, full head rotation. Attention is one kernel over all ``physical_cap`` slots, masked by
``pos_buf``. TriAttention scoring is replaced by keep-the-most-recent ``budget`` rows. ``hipMemcpy`` of
``to_ne_bytes()`` is a blocking ``copy_`` from a 1-element host tensor (inlined at the FA-layer sites). ``stream_write_value32`` is a device
``fill_``. Capture+launch is the kit's capture (no warmup: the direct warmup is the upstream call before it)
followed by a replay. The daemon runs two requests, with a ``reset`` between them (``seq_pos = 0``,
``compact_offset = 0``). First, a 10-token prompt that evicts after prefill (budget 6, beta 2, so
``compact_offset = 4``), decoding 4 tokens greedily; one more eviction happens mid-decode. Second, a 3-token prompt
decoding 4 tokens, with no eviction: in the fix its decode warms up, captures and replays. Eager is the same daemon
with ``HIPFIRE_GRAPH=0``.
"""
from __future__ import annotations

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/warpfront/hipfire/pull/269"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "forward_scratch_layers"
SYMPTOM = ("daemon panics with HipError 906 (hipMemcpy H2D: operation would make the legacy stream depend on a "
           "capturing blocking stream) on the first AR-decode hipGraph capture after TriAttention KV eviction")

DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, VOCAB, N_LAYERS = 8, 2, 1, 4, 16, 2
ROPE_THETA, PARTIAL_ROTARY_FACTOR, NORM_EPS = 10000.0, 1.0, 1e-6
PHYSICAL_CAP, BUDGET, BETA = 12, 6, 2
MAX_TOKENS = 4


# --- crates/hip-bridge: HipRuntime ----------------------------------------------------------------------------

class HipRuntime:
    def __init__(self, device):
        self.device = device

    def memcpy_htod(self, dst, src):
        """hipMemcpy H2D: synchronous, on the legacy (null) stream."""
        dst.copy_(src)

    def memcpy_htod_async(self, dst, src, stream):
        """hipMemcpyAsync H2D on ``stream`` (under capture: a memcpy node)."""
        dst.copy_(src, non_blocking=True)

    def stream_write_value32(self, stream, dst, value, flags):
        """hipStreamWriteValue32: the device writes ``value`` into ``dst`` in stream order (no host copy)."""
        dst.fill_(value)


def to_ne_bytes(value: int, device) -> torch.Tensor:
    """``(value as i32).to_ne_bytes()``: the 4 host bytes handed to an H2D copy."""
    return host(torch.tensor([value], dtype=torch.int32), device)


# --- crates/rdna-compute/src/dispatch.rs: Gpu -----------------------------------------------------------------

class Gpu:
    def __init__(self, device, variant, graph_env: bool):
        self.device = device
        self.variant = variant
        self.hip = HipRuntime(device)
        self.hipfire_graph = graph_env          # hipGraph on (default-ON on gfx11/gfx12) or HIPFIRE_GRAPH=0
        self.capture_mode = False
        self.graph_exec = None                  # (graph, outputs) once instantiated
        self.ar_forward_warmed_up = False
        self.active_stream = None

    def memcpy_htod_auto(self, dst, src):
        """#269: H->D copy that picks async on the active stream when capturing."""
        if self.capture_mode:
            stream = self.active_stream
            assert stream is not None, "capture mode requires an active stream"
            self.hip.memcpy_htod_async(dst, src, stream)
        else:
            self.hip.memcpy_htod(dst, src)

    def capture_graph(self, record, static, state):
        """begin_graph_capture / record / end_graph_capture (hipStreamBeginCapture .. hipGraphInstantiate)."""
        self.capture_mode = True
        try:
            self.graph_exec = capture(record, device=self.device, warmups=0, name="qwen35 AR forward",
                                      static=static, state=state, owner="Gpu (qwen35 AR hipGraph)")
        finally:
            self.capture_mode = False

    def graph_launch(self):
        g, out = self.graph_exec
        return replay(g, out)

    # --- kernels -------------------------------------------------------------------------------------------

    def rmsnorm_f32(self, x, w, out):
        out.copy_(x * torch.rsqrt(x.pow(2).mean() + NORM_EPS) * w)

    def gemv_f32(self, w, x, out):
        out.copy_(x @ w)

    def rope_partial_interleaved_f32(self, q, k, pos_buf, n_heads, n_kv_heads, head_dim, n_rot, theta, inv_freq):
        """Rotates pairs (x[2i], x[2i+1]) of the first ``n_rot`` dims of every head by ``pos * theta^(-2i/n_rot)``,
        the position read from ``pos_buf`` on the device."""
        ang = pos_buf.to(torch.float32) * inv_freq                        # [n_rot / 2]
        cos, sin = torch.cos(ang), torch.sin(ang)
        for t, heads in ((q, n_heads), (k, n_kv_heads)):
            v = t.view(heads, head_dim)[:, :n_rot].view(heads, n_rot // 2, 2)
            x0, x1 = v[..., 0].clone(), v[..., 1].clone()
            v[..., 0].copy_(x0 * cos - x1 * sin)
            v[..., 1].copy_(x0 * sin + x1 * cos)

    def kv_cache_write(self, cache, src, pos_buf, kv_dim):
        cache.index_copy_(0, pos_buf.to(torch.long), src.view(1, kv_dim))

    def attention_f32(self, q, k_cache, v_cache, out, pos_buf, slot_ids, n_heads, n_kv_heads, head_dim):
        """Position-independent grid over all physical_cap slots; slots past pos_buf are masked."""
        qh = q.view(n_heads, head_dim)
        kh = k_cache.view(-1, n_kv_heads, head_dim).repeat_interleave(n_heads // n_kv_heads, dim=1)
        vh = v_cache.view(-1, n_kv_heads, head_dim).repeat_interleave(n_heads // n_kv_heads, dim=1)
        scores = torch.einsum("hd,shd->hs", qh, kh) / head_dim ** 0.5
        scores = scores.masked_fill((slot_ids > pos_buf)[None, :], float("-inf"))
        out.copy_(torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), vh).reshape(-1))

    def sigmoid_mul_f32(self, x, gate):
        x.mul_(torch.sigmoid(gate))


# --- crates/engine/src/llama.rs: KvCache; crates/engine/src/triattn.rs: eviction -------------------------------

class KvCache:
    def __init__(self, device):
        kv_dim = N_KV_HEADS * HEAD_DIM
        self.k_gpu = [torch.zeros(PHYSICAL_CAP, kv_dim, device=device) for _ in range(N_LAYERS)]
        self.v_gpu = [torch.zeros(PHYSICAL_CAP, kv_dim, device=device) for _ in range(N_LAYERS)]
        self.physical_cap = PHYSICAL_CAP
        # for new writes: compact_offset = absolute_seq_len - physical_seq_len
        self.compact_offset = 0


class TriAttnEviction:
    def __init__(self, budget, beta):
        self.budget, self.beta = budget, beta

    def maybe_evict(self, gpu, kv, current_physical):
        """Compacts the cache to ``budget`` rows once it holds ``budget + beta`` or more. Scoring reduced to
        keep-the-most-recent rows; the rows keep their post-RoPE keys (absolute phase)."""
        if current_physical <= self.budget + self.beta:
            return None
        keep = slice(current_physical - self.budget, current_physical)
        for layer_idx in range(N_LAYERS):
            for cache in (kv.k_gpu[layer_idx], kv.v_gpu[layer_idx]):
                cache[:self.budget].copy_(cache[keep].clone())
        kv.compact_offset += current_physical - self.budget
        return self.budget                                                # EvictionResult.new_physical


# --- crates/engine/src/qwen35.rs ---------------------------------------------------------------------------------

class Qwen35Weights:
    def __init__(self, device):
        gen = generator(269)
        q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
        self.token_embd = randn(VOCAB, DIM, gen=gen, device=device)
        self.layers = []
        for _ in range(N_LAYERS):
            self.layers.append({
                "attn_norm": 1.0 + randn(DIM, gen=gen, device=device, scale=0.1),
                "wq": randn(DIM, 2 * q_dim, gen=gen, device=device, scale=0.6),     # Q + gate, interleaved per head
                "wk": randn(DIM, kv_dim, gen=gen, device=device, scale=0.6),
                "wv": randn(DIM, kv_dim, gen=gen, device=device, scale=0.6),
                "wo": randn(q_dim, DIM, gen=gen, device=device, scale=0.5),
            })
        self.output_norm = 1.0 + randn(DIM, gen=gen, device=device, scale=0.1)
        self.output = randn(DIM, VOCAB, gen=gen, device=device, scale=0.8)


class Qwen35Scratch:
    def __init__(self, device):
        q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
        self.x = torch.zeros(DIM, device=device)                         # embedding output (per step)
        self.h = torch.zeros(DIM, device=device)                         # residual stream
        self.tmp = torch.zeros(DIM, device=device)
        self.pos_buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.slot_ids = torch.arange(PHYSICAL_CAP, dtype=torch.int32, device=device)
        self.fa_q_full = torch.zeros(2 * q_dim, device=device)
        self.fa_q = torch.zeros(q_dim, device=device)
        self.fa_gate = torch.zeros(q_dim, device=device)
        self.fa_k = torch.zeros(kv_dim, device=device)
        self.fa_v = torch.zeros(kv_dim, device=device)
        self.fa_attn_out = torch.zeros(q_dim, device=device)
        self.logits = torch.zeros(VOCAB, device=device)
        n_rot = int(HEAD_DIM * PARTIAL_ROTARY_FACTOR)
        self.inv_freq = ROPE_THETA ** (-torch.arange(0, n_rot, 2, dtype=torch.float32, device=device) / n_rot)


def forward_scratch(gpu, weights, token, pos, kv_cache, scratch):
    """Zero-alloc forward pass using pre-allocated scratch buffers. Logits stay on GPU in scratch.logits."""
    use_graph = gpu.hipfire_graph
    if gpu.variant == "fix":
        # 59e94596: the captured route has no dynamic compact_offset input -- neither capture nor replay it
        # once the cache is compacted; such steps run direct.
        use_graph = use_graph and kv_cache.compact_offset == 0

    # Embedding lookup into scratch.x (always direct, changes per token)
    scratch.x.copy_(weights.token_embd[token])

    if use_graph and gpu.graph_exec is not None:
        # -- Graph replay path: update pos_buf on the device via stream write (no host->device copy). --
        gpu.hip.stream_write_value32(gpu.active_stream, scratch.pos_buf, pos, 0)
        gpu.graph_launch()
    elif use_graph and gpu.graph_exec is None:
        pos_i32 = pos
        if not gpu.ar_forward_warmed_up:
            # -- Warmup: run direct so kernel JIT and lazy scratch allocations happen outside any capture. --
            gpu.ar_forward_warmed_up = True
            gpu.hip.memcpy_htod(scratch.pos_buf, to_ne_bytes(pos_i32, gpu.device))
            forward_scratch_layers(gpu, weights, pos, kv_cache, scratch)
        else:
            # -- First post-warmup call: capture the forward pass as a graph --
            if gpu.active_stream is None:
                gpu.active_stream = "hipStreamCreate"
            # Write pos_buf before capture (this write is NOT in the graph)
            gpu.hip.memcpy_htod(scratch.pos_buf, to_ne_bytes(pos_i32, gpu.device))
            state = {f"k_gpu[{i}]": kv_cache.k_gpu[i] for i in range(N_LAYERS)}
            state.update({f"v_gpu[{i}]": kv_cache.v_gpu[i] for i in range(N_LAYERS)})
            gpu.capture_graph(lambda: forward_scratch_layers(gpu, weights, pos, kv_cache, scratch),
                              static={"scratch.x": scratch.x, "scratch.pos_buf": scratch.pos_buf}, state=state)
            # Capture RECORDS kernels; launch the freshly-instantiated graph once so this pos's forward runs.
            gpu.graph_launch()
    else:
        # -- Direct path (no graph) --
        gpu.hip.memcpy_htod(scratch.pos_buf, to_ne_bytes(pos, gpu.device))
        forward_scratch_layers(gpu, weights, pos, kv_cache, scratch)


def forward_scratch_layers(gpu, weights, pos, kv_cache, s):
    kv_dim = N_KV_HEADS * HEAD_DIM
    n_rot = int(HEAD_DIM * PARTIAL_ROTARY_FACTOR)
    s.h.copy_(s.x)
    for layer_idx, layer in enumerate(weights.layers):            # every layer FullAttention here
        gpu.rmsnorm_f32(s.h, layer["attn_norm"], s.tmp)
        gpu.gemv_f32(layer["wq"], s.tmp, s.fa_q_full)
        gpu.gemv_f32(layer["wk"], s.tmp, s.fa_k)
        gpu.gemv_f32(layer["wv"], s.tmp, s.fa_v)
        qg = s.fa_q_full.view(N_HEADS, 2, HEAD_DIM)                   # deinterleave_f32
        s.fa_q.view(N_HEADS, HEAD_DIM).copy_(qg[:, 0])
        s.fa_gate.view(N_HEADS, HEAD_DIM).copy_(qg[:, 1])

        # If TriAttention has compacted the cache, absolute RoPE phase diverges from the physical cache index.
        # Temporarily load the absolute position into pos_buf for the rope call, then restore the physical
        # position for kv_cache_write + flash attention (which both want the write slot).
        if kv_cache.compact_offset > 0:
            abs_pos = pos + kv_cache.compact_offset
            if gpu.variant == "fix":
                gpu.memcpy_htod_auto(s.pos_buf, to_ne_bytes(abs_pos, gpu.device))
            else:   # bug: gpu.hip.memcpy_htod(&s.pos_buf, &abs.to_ne_bytes()) -- a synchronous hipMemcpy on the
                # legacy stream (inlined here), which a capturing stream refuses (HipError 906)
                s.pos_buf.copy_(to_ne_bytes(abs_pos, gpu.device))
        gpu.rope_partial_interleaved_f32(s.fa_q, s.fa_k, s.pos_buf, N_HEADS, N_KV_HEADS, HEAD_DIM, n_rot,
                                         ROPE_THETA, s.inv_freq)
        if kv_cache.compact_offset > 0:
            phys = pos
            if gpu.variant == "fix":
                gpu.memcpy_htod_auto(s.pos_buf, to_ne_bytes(phys, gpu.device))
            else:   # gpu.hip.memcpy_htod(&s.pos_buf, &phys.to_ne_bytes())
                s.pos_buf.copy_(to_ne_bytes(phys, gpu.device))

        gpu.kv_cache_write(kv_cache.k_gpu[layer_idx], s.fa_k, s.pos_buf, kv_dim)
        gpu.kv_cache_write(kv_cache.v_gpu[layer_idx], s.fa_v, s.pos_buf, kv_dim)
        gpu.attention_f32(s.fa_q, kv_cache.k_gpu[layer_idx], kv_cache.v_gpu[layer_idx], s.fa_attn_out,
                          s.pos_buf, s.slot_ids, N_HEADS, N_KV_HEADS, HEAD_DIM)
        # Fused: fa_attn_out *= sigmoid(fa_gate); then wo GEMV + residual add
        gpu.sigmoid_mul_f32(s.fa_attn_out, s.fa_gate)
        s.h.add_(s.fa_attn_out @ layer["wo"])
    gpu.rmsnorm_f32(s.h, weights.output_norm, s.tmp)
    gpu.gemv_f32(weights.output, s.tmp, s.logits)
    return s.logits


def forward_prefill_batch(gpu, weights, tokens, start_pos, kv_cache, scratch):
    """Prefill, direct (no graph): here one token at a time through the same layers."""
    for i, token in enumerate(tokens):
        scratch.x.copy_(weights.token_embd[token])
        gpu.hip.memcpy_htod(scratch.pos_buf, to_ne_bytes(start_pos + i, gpu.device))
        forward_scratch_layers(gpu, weights, start_pos + i, kv_cache, scratch)


# --- crates/engine/examples/daemon.rs ----------------------------------------------------------------------------

class LoadedModel:
    def __init__(self, device):
        self.weights = Qwen35Weights(device)
        self.kv_cache = KvCache(device)
        self.scratch = Qwen35Scratch(device)
        self.eviction = TriAttnEviction(BUDGET, BETA)
        self.seq_pos = 0                        # the *physical* write slot under eviction


def generate(m, gpu, prompt_tokens, max_tokens):
    """Prefill, post-prefill evict, then greedy decode; the next token's K/V is written before sampling."""
    kv, scratch = m.kv_cache, m.scratch
    forward_prefill_batch(gpu, m.weights, prompt_tokens, m.seq_pos, kv, scratch)
    m.seq_pos += len(prompt_tokens)
    new_phys = m.eviction.maybe_evict(gpu, kv, m.seq_pos)
    if new_phys is not None:
        m.seq_pos = new_phys
    step_logits = []
    next_token = int(scratch.logits.argmax())
    for _ in range(max_tokens):
        forward_scratch(gpu, m.weights, next_token, m.seq_pos, kv, scratch)
        step_logits.append(scratch.logits.clone())
        m.seq_pos += 1
        new_phys = m.eviction.maybe_evict(gpu, kv, m.seq_pos)
        if new_phys is not None:
            m.seq_pos = new_phys
        next_token = int(scratch.logits.argmax())
    return step_logits


def reset(m):
    """The daemon's "reset": fresh conversation; under eviction the compact_offset restarts from zero."""
    m.seq_pos = 0
    m.kv_cache.compact_offset = 0


def run(variant: str, device: str = "cpu"):
    long_prompt = [3, 7, 1, 12, 5, 9, 2, 14, 6, 11]                     # evicts after prefill (10 > 6 + 2)
    short_prompt = [4, 8, 13]

    def daemon(graph_env: bool):
        gpu = Gpu(device, variant, graph_env)
        m = LoadedModel(device)
        outs = generate(m, gpu, long_prompt, MAX_TOKENS)
        reset(m)
        outs += generate(m, gpu, short_prompt, MAX_TOKENS)
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: daemon(True), lambda: daemon(False))
