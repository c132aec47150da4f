"""fak (anthony-chaudhary/fak, a Go agent kernel with an in-process LLM engine whose CUDA backend captures each token's
op stream into a CUDA graph and launches it) opened the capture of a token once two tokens had run through the HAL
(``halStep >= 2``), on the assumption that two uncaptured tokens had warmed the backend's exact-size buffer pool and
its resident-weight cache. But prompt ingestion runs every prompt token but the last as a ``halNoLogits`` step, which
returns before the logits path: with a prompt of three or more tokens the first token that reaches the logits path
(the last prompt token) is already captured. There it uploads ``model.norm`` and ``lm_head`` and asks for the
vocab-wide logits buffer, all pool misses that fall through to ``cudaMalloc``, which a capturing stream refuses: the
in-kernel serve crashed on its warm-up turn with ``FAK_CUDA_GRAPH=1`` and worked without it. The fix captures only a
logits-producing step, and only after one logits-producing step has run uncaptured (``halLogitsWarm``).

Upstream: https://github.com/anthony-chaudhary/fak/commit/d7d61725c305dfe4dde524b0d25715a0821a48b1 ("fix(compute): warm
the logits path before CUDA-graph capture so device decode stops crashing (#932) (fak compute)",
anthony-chaudhary/fak, by anthony-chaudhary, authored 2026-06-27 03:06 -0700, committed 03:08; a direct commit to
main, no pull request), for issue https://github.com/anthony-chaudhary/fak/issues/932 ("perf(cuda): witness
--cuda-graph decode replay at 27B on A100 ...", closed). Read, in a mirror of the repository: the whole diff of
d7d61725 (``internal/model/hal.go``, ``internal/model/kv.go``, ``internal/compute/cuda.go``, ``cuda_backend.h``,
``cuda_kernels.cu``, ``graph_cuda.go``, ``graph_nocuda.go``, ``cmd/fak/serve.go``) and its message; at the parent
d7d61725^: ``internal/model/hal.go`` (``NewBackendSession``, ``Close``, ``uploadHostF32``, ``weightHAL``,
``matWeightHAL``, ``lmHeadHAL``, ``lmHeadMatHAL``, the optional-capability interfaces, ``tokenHALOutput``,
``tokenHAL``, ``tokenHALNoLogits``, ``tokenHALArgmax``, ``recycleHALToken``, ``prefillHAL``), ``internal/model/kv.go``
(``Session`` fields, ``token``, the two HAL prefill callers), ``internal/compute/cuda.go`` (``Recycle``,
``GraphBegin``, ``GraphEndLaunch``, ``GraphReset``, ``Upload`` / ``UploadClass`` / ``uploadClass``, ``dalloc``,
``dallocClass``, ``dallocWeight``, ``dev``, ``devTr``, ``Read``/``Free`` (names), ``Attention``, ``cudaKVMaxPos``,
``NewKV``, ``dallocKV``, ``growAppend``, ``cudaKV.AppendKV``, ``Len``), ``internal/compute/cuda_kernels.cu``
(``fcuda_malloc``, ``fcuda_free``, ``g_pool``, ``fcuda_graph_begin``, ``fcuda_graph_end_launch``) and
``internal/compute/cuda_graph_test.go`` (``TestCUDAGraphDecodeParity``, which warms two tokens before capturing
"mirroring the HAL's halStep>=2 warm-up gate"); of issue #932 the root-cause comment as stored in the search corpus.
Not read: the rest of issue #932's thread; the in-kernel chat serve loop and its ``oom-retry`` path (``cmd/fak``,
the gateway); the CUDA kernels' bodies (``fcuda_rmsnorm_f32``, ``fcuda_rope_f32``, ``fcuda_flash_attention_f32``,
``fcuda_kv_write``, the GEMMs); the Q8/Q4_K/F16 upload paths; the residency budget. Not established: whether the
crashing serve's weights were F32 (the log's ``site=dalloc`` is the F32 ``Upload`` -> ``dev`` -> ``dalloc`` path, which
I follow) and which exact operation of the logits path missed first beyond the log's one size.
Symptom: the commit: "FAK_CUDA_GRAPH=1 crashed the in-kernel serve: the first captured logits step uploaded
model.norm + lm_head and allocated the vocab-wide logits buffer via cudaMalloc DURING capture (illegal)". Issue #932,
on a 14B model's warm-up turn (about ten positions, a fresh process where the non-graph path works): "fak-cuda:
cudaMalloc(20480 bytes) failed: operation not permitted when stream is capturing" (20480 = 5120 x 4, ``hidden_size``
floats: ``model.norm``), then a cascade of failed allocations because the panic unwound past ``GraphEndLaunch`` and
left the stream capturing.
Mechanism: the pool (``g_pool``) keys free buffers by exact byte size and ``fcuda_malloc`` falls through to
``cudaMalloc`` on a miss; op outputs are transients that ``Recycle`` returns at each token boundary, weights are
uploaded once on first use and cached in ``halW``. ``prefillHAL`` runs ``tokenHALNoLogits`` for each prompt token but
the last, and ``tokenHALOutput`` returns right after the layer loop for ``halNoLogits``. So after two prompt tokens
the pool holds every size the layers need, and the capture gate opens: the captured noLogits prompt steps are fine,
but the last prompt token, the first to run the logits path, runs it inside the capture, where its ``model.norm``
upload misses the pool (in my reading the layers' transients have taken every ``hidden_size`` buffer; here they
do) and ``cudaMalloc`` is refused. Eager steps allocate the same buffers harmlessly. A prompt of one or two tokens
warms the logits path before the gate opens; the device test warms two tokens that both produce logits, so it could
not show this.
Doctor: sync-in-capture, at tokenHALOutput: a forbidden runtime call (``cudaMalloc``, reached from the pool miss of
the logits path's first upload) runs inside the captured token; ``tokenHALOutput`` holds the capture gate that opened
the capture before that path had ever run uncaptured, and the gate is what the fix changes.
Fix (upstream): the gate becomes ``canGraph && mode != halNoLogits && s.halLogitsWarm``; ``finishGraph`` sets
``halLogitsWarm`` after any logits-producing step; ``halStep`` stays as a diagnostic counter. The same commit adds
``GraphAbort`` (end and discard an open capture on the panic path, so one refused allocation no longer leaves the
stream capturing) and ``SetCUDAGraphKVCapacity`` (the fixed device-KV preallocation follows the context budget).
Modelled: ``Model`` (``tensor``, ``has``, ``embedRows``), ``Session`` (``NewBackendSession``, ``uploadHostF32``,
``weightHAL``, ``matWeightHAL``, ``lmHeadHAL``, ``tokenHALOutput`` with ``finishGraph``, ``tokenHAL``,
``tokenHALNoLogits``, ``recycleHALToken``, ``prefillHAL``, ``Prefill``, ``Step``/``token``; fields ``halStep``,
``halLogitsWarm``, ``halW``, ``halKV``), ``cudaBackend`` (``GraphBegin``, ``GraphEndLaunch``, ``GraphReset``,
``Upload``, ``UploadClass``, ``uploadClass``, ``dalloc``, ``dallocClass``, ``dev``, ``devTr``, ``Recycle``, ``Free``,
``Read``, ``MatMul``, ``RMSNorm``, ``RoPE``, ``SwiGLU``, ``AddInPlace``, ``Attention``, ``NewKV``, ``dallocKV``,
``growAppend``), ``cudaKV`` (``AppendKV``, ``Len``), ``dslice``, and the C layer ``fcuda_malloc`` / ``fcuda_free`` /
``g_pool`` / ``g_live`` / ``fcuda_h2d`` over ``cudaMalloc``; ``EnableCUDAGraph`` / ``graphEnabled``.
Stand-ins: ``cudaMalloc`` raises the runtime's refusal (the engine's ``CaptureError``, with upstream's stderr text)
when the current stream is capturing; upstream returns the error, ``fcuda_malloc`` prints it, ``dallocClass`` tries
``cudaMallocManaged`` (refused too) and panics with a ``DeviceAllocError``. ``GraphBegin`` only gives consent
(``graphEnabled``); the ops from there to ``finishGraph`` are the closure ``step``, which ``kit.capture`` records,
and ``GraphEndLaunch`` (end, instantiate or ``cudaGraphExecUpdate`` the kept exec, launch, fence) is ``kit.replay``
of a graph captured per token; the kept exec and ``GraphReset`` are not modelled, nor ``GraphAbort`` (the engine
ends a capture an exception leaves). Host memory is ``host()`` memory; buffers are float64 (8 bytes an element, where
upstream's are f32). ``AppendKV`` writes the row at ``pos`` (upstream writes at the host length ``d.len``, which is
``pos`` rows in this workload) and keeps the length at least ``pos + 1``, so a step run twice writes the same row.
Only the F32 single-token path is modelled (no fused or quantized backends, no ``halArgmax``: the HAL's ``Step``
reads full logits); RoPE is the half-split form; the model is mine: 2 layers of width 16, 2 query heads and 1 KV head
of 8, SwiGLU of 32, vocabulary 24, ``cudaKVMaxPos`` 16.
Workload: one session: ``Prefill`` of a 5-token prompt (its last token's logits), then 4 greedy ``Step`` s, each
one's logits an output; without graphs (``graphEnabled`` false) and with them.
Measured: the check printed (each line wrapped here)
  fak_d7d6172_capture_gate_counts_prefill_steps_logits_path_unwarmed [bug] on cpu: misbehaves (raised CaptureError:
    fak-cuda: cudaMalloc(128 bytes) failed: operation not permitted when stream is capturing)
  fak_d7d6172_capture_gate_counts_prefill_steps_logits_path_unwarmed [fix] on cpu: equals eager
    (max |graph - eager| = 0)
In the bug the prompt's tokens 2 and 3 are captured (noLogits) and launched without trouble; token 4's capture asks
for ``model.norm`` (16 float64: 128 bytes, upstream's 20480) while the pool's 16-element bucket is empty. With the fix
prompt ingestion runs eagerly and the 4 decode steps are captured and launched; their logits equal the run without
graphs. Both variants take well under a second.
"""
from __future__ import annotations

import math

import torch

from workbench.engine import CaptureError, host
from workbench.engine.source import user_frame
from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/anthony-chaudhary/fak/commit/d7d61725c305dfe4dde524b0d25715a0821a48b1"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "tokenHALOutput"
SYMPTOM = ("With FAK_CUDA_GRAPH=1 the in-kernel serve crashed on its first turn: the capture opened after two "
           "prompt tokens, and the last prompt token's logits path, never run uncaptured, hit cudaMalloc inside "
           "the capture ('operation not permitted when stream is capturing')")

DTYPE = torch.float64
ELEM_BYTES = 8
VOCAB, HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, FFN, NUM_LAYERS = 24, 16, 2, 1, 8, 32, 2
RMS_EPS, ROPE_THETA = 1e-6, 10000.0
cudaKVMaxPos = 16
PROMPT, NEW_TOKENS = [3, 11, 6, 19, 2], 4

halNoLogits, halFullLogits = 0, 1
graphEnabled = False
_variant = "bug"


def EnableCUDAGraph(on: bool = True) -> None:
    global graphEnabled
    graphEnabled = on


# --- cuda_kernels.cu: the runtime allocation and the caching allocator --------------------------------------------

def cudaMalloc(nbytes: int, device: str) -> torch.Tensor:
    """The runtime allocation; a stream capturing in global mode refuses it."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"fak-cuda: cudaMalloc({nbytes} bytes) failed: operation not permitted when stream is "
                           f"capturing\n  at {user_frame()}", op="cudaMalloc", source=user_frame())
    return torch.empty(nbytes // ELEM_BYTES, dtype=DTYPE, device=device)


class fcuda:
    """``g_pool`` (free buffers by exact byte size) and ``g_live`` (live buffer -> its size)."""

    def __init__(self, device: str):
        self.device = device
        self.g_pool: dict[int, list[torch.Tensor]] = {}
        self.g_live: dict[int, tuple[torch.Tensor, int]] = {}

    def fcuda_malloc(self, nbytes: int) -> torch.Tensor:
        bucket = self.g_pool.get(nbytes)
        d = bucket.pop() if bucket else cudaMalloc(nbytes, self.device)   # a miss falls through to cudaMalloc
        self.g_live[d.data_ptr()] = (d, nbytes)
        return d

    def fcuda_free(self, d: torch.Tensor) -> None:
        live = self.g_live.pop(d.data_ptr(), None)
        if live is not None:
            self.g_pool.setdefault(live[1], []).append(live[0])         # back to the pool, no cudaFree

    @staticmethod
    def fcuda_h2d(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


# --- internal/compute/cuda.go -----------------------------------------------------------------------------------

class dslice:
    """A growable VRAM float buffer; ``len`` and ``cap`` in rows of the KV width here."""

    def __init__(self, buf=None, cap: int = 0):
        self.buf, self.len, self.cap = buf, 0, cap


class cudaKV:
    def __init__(self, be: "cudaBackend"):
        self.be, self.maxPos = be, 0
        self.w = NUM_KV_HEADS * HEAD_DIM
        self.K = [dslice() for _ in range(NUM_LAYERS)]
        self.Kraw = [dslice() for _ in range(NUM_LAYERS)]
        self.V = [dslice() for _ in range(NUM_LAYERS)]
        self.pos: list[int] = []

    def AppendKV(self, layer: int, kRaw, kRoPE, v, pos: int) -> None:
        self.be.growAppend(self.Kraw[layer], kRaw, pos)
        self.be.growAppend(self.K[layer], kRoPE, pos)
        self.be.growAppend(self.V[layer], v, pos)
        if layer == 0 and (not self.pos or self.pos[-1] != pos):
            self.pos.append(pos)

    def Len(self) -> int:
        return len(self.pos)

    def buffers(self) -> dict:
        return {f"{n}[{l}]": d.buf for n, ds in (("K", self.K), ("Kraw", self.Kraw), ("V", self.V))
                for l, d in enumerate(ds)}


class cudaBackend:
    """The graph-capable device backend (``graphBackend``: ``GraphBegin`` / ``GraphEndLaunch``)."""

    def __init__(self, device: str):
        self.device = device
        self.c = fcuda(device)
        self.transient: list[torch.Tensor] = []
        half = HEAD_DIM // 2
        self.inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=DTYPE, device=device) / half)
        self.kv_head = torch.arange(NUM_HEADS, device=device) // (NUM_HEADS // NUM_KV_HEADS)

    # residency
    def dallocClass(self, nbytes: int, klass: str, site: str) -> torch.Tensor:
        return self.c.fcuda_malloc(nbytes)

    def dalloc(self, nbytes: int) -> torch.Tensor:
        return self.dallocClass(nbytes, "unknown", "dalloc")

    def dev(self, shape) -> torch.Tensor:
        n = math.prod(shape)
        return self.dalloc(n * ELEM_BYTES).view(shape)

    def devTr(self, shape) -> torch.Tensor:
        """``dev`` for an op OUTPUT: registered as transient, so ``Recycle`` returns it to the pool."""
        b = self.dallocClass(math.prod(shape) * ELEM_BYTES, "scratchpad", "transient")
        self.transient.append(b)
        return b.view(shape)

    def Recycle(self) -> None:
        for b in self.transient:
            self.c.fcuda_free(b)
        self.transient.clear()

    def Free(self, t: torch.Tensor) -> None:
        self.c.fcuda_free(t)

    def Upload(self, t: torch.Tensor) -> torch.Tensor:
        return self.uploadClass(t, "weights", "upload-weight")

    def UploadClass(self, t: torch.Tensor, klass: str, site: str) -> torch.Tensor:
        return self.uploadClass(t, klass, site)

    def uploadClass(self, t: torch.Tensor, klass: str, site: str) -> torch.Tensor:
        if klass != "weights":                               # activation/runtime uploads: dallocClass + H2D
            out = self.dallocClass(t.numel() * ELEM_BYTES, klass, site).view(t.shape)
        else:                                                # F32 weights: dev -> dalloc ("site=dalloc")
            out = self.dev(t.shape)
        self.c.fcuda_h2d(out, t)
        return out

    def Read(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", copy=True)                        # fcuda_d2h into a host slice

    # ops (each output a transient)
    def MatMul(self, w, x):
        y = self.devTr([x.shape[0], w.shape[0]])
        torch.matmul(x, w.t(), out=y)
        return y

    def RMSNorm(self, x, weight, eps: float):
        y = self.devTr(list(x.shape))
        y.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight)
        return y

    def RoPE(self, x, pos: int, nHeads: int, headDim: int):
        y = self.devTr(list(x.shape))
        y.copy_(x)                                           # fcuda_d2d, then fcuda_rope_f32 in place
        ang = self.inv_freq * pos
        cos, sin = torch.cos(ang), torch.sin(ang)
        h = y.view(nHeads, headDim)
        a, b = h[:, :headDim // 2].clone(), h[:, headDim // 2:].clone()
        h[:, :headDim // 2].copy_(a * cos - b * sin)
        h[:, headDim // 2:].copy_(b * cos + a * sin)
        return y

    def SwiGLU(self, gate, up):
        y = self.devTr(list(gate.shape))
        y.copy_(torch.nn.functional.silu(gate) * up)
        return y

    def AddInPlace(self, dst, src):
        dst.add_(src)

    def Attention(self, q, kv: cudaKV, layer: int, scale: float):
        out = self.devTr(list(q.shape))
        nPos, w = kv.K[layer].len, kv.w                      # a host value, a kernel parameter
        keys = kv.K[layer].buf[:nPos * w].view(nPos, NUM_KV_HEADS, HEAD_DIM)[:, self.kv_head]
        vals = kv.V[layer].buf[:nPos * w].view(nPos, NUM_KV_HEADS, HEAD_DIM)[:, self.kv_head]
        qh = q.view(NUM_HEADS, HEAD_DIM)
        probs = torch.softmax(torch.einsum("hd,phd->hp", qh, keys) * scale, dim=-1)
        out.copy_(torch.einsum("hp,phd->hd", probs, vals).reshape(q.shape))
        return out

    # device KV
    def NewKV(self) -> cudaKV:
        k = cudaKV(self)
        if graphEnabled:       # a cudaMalloc mid-token is illegal under capture: preallocate a fixed capacity
            k.maxPos = cudaKVMaxPos
            for ds in (k.K, k.Kraw, k.V):
                for l in range(NUM_LAYERS):
                    ds[l].buf, ds[l].cap = self.dallocKV(cudaKVMaxPos * k.w * ELEM_BYTES), cudaKVMaxPos
        return k

    def dallocKV(self, nbytes: int) -> torch.Tensor:
        return self.dallocClass(nbytes, "kv_cache", "kv-cache")

    def growAppend(self, d: dslice, src, pos: int) -> None:
        w = src.numel()
        if pos + 1 > d.cap:                                  # the growable (non-graph) cache reallocates
            ncap = d.cap * 2 + 1
            nb = self.dallocKV(ncap * w * ELEM_BYTES)
            if d.len > 0:
                nb[:d.len * w].copy_(d.buf[:d.len * w])
            if d.buf is not None:
                self.c.fcuda_free(d.buf)
            d.buf, d.cap = nb, ncap
        d.buf[pos * w:(pos + 1) * w].copy_(src.reshape(-1))  # fcuda_kv_write
        d.len = max(d.len, pos + 1)

    # graphs
    def GraphBegin(self) -> bool:
        return graphEnabled        # fcuda_graph_begin: cudaStreamBeginCapture(g_stream, global mode)

    def GraphEndLaunch(self, g, out):
        return replay(g, out)      # fcuda_graph_end_launch: end capture, instantiate/update, launch, fence

    def GraphReset(self) -> None:
        pass                       # drops the kept exec (a new graph is captured per token here)


# --- internal/model: the model, its session and the HAL step -----------------------------------------------------

class Model:
    def __init__(self, device: str):
        gen = generator(932)

        def w(*shape, scale=0.3, base=0.0):
            return host(base + torch.randn(*shape, generator=gen, dtype=DTYPE) * scale, device)

        self.manifest: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0)}
        for l in range(NUM_LAYERS):
            p = f"model.layers.{l}."
            self.manifest.update({
                p + "input_layernorm.weight": w(HIDDEN, scale=0.1, base=1.0),
                p + "self_attn.q_proj.weight": w(NUM_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, NUM_HEADS * HEAD_DIM),
                p + "post_attention_layernorm.weight": w(HIDDEN, scale=0.1, base=1.0),
                p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
                p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, FFN, scale=0.2),
            })
        self.manifest["model.norm.weight"] = w(HIDDEN, scale=0.1, base=1.0)
        self.manifest["lm_head.weight"] = w(VOCAB, HIDDEN)

    def tensor(self, name: str) -> torch.Tensor:
        return self.manifest[name]

    def has(self, name: str) -> bool:
        return name in self.manifest

    def embedRows(self) -> torch.Tensor:
        return self.manifest["model.embed_tokens.weight"]


def layerName(l: int, s: str) -> str:
    return f"model.layers.{l}.{s}"


class Session:
    def __init__(self, m: Model, be: cudaBackend, kv: cudaKV):
        self.M, self.Backend, self.halKV = m, be, kv
        self.halW: dict[str, torch.Tensor] = {}
        self.halStep = 0                 # tokens run through the HAL
        self.halLogitsWarm = False       # (the fix) a logits-producing step has run uncaptured

    @staticmethod
    def NewBackendSession(m: Model, be: cudaBackend) -> "Session":
        kv = be.NewKV()
        be.GraphReset()
        return Session(m, be, kv)

    def uploadHostF32(self, data: torch.Tensor, klass: str, site: str) -> torch.Tensor:
        if klass == "weights":
            return self.Backend.Upload(data)
        return self.Backend.UploadClass(data, klass, site)

    def weightHAL(self, name: str) -> torch.Tensor:
        t = self.halW.get(name)
        if t is not None:
            return t             # already resident; never re-upload an immutable weight
        t = self.uploadHostF32(self.M.tensor(name), "weights", "hal-weight " + name)
        self.halW[name] = t
        return t

    def matWeightHAL(self, name: str) -> torch.Tensor:
        return self.weightHAL(name)

    def lmHeadHAL(self) -> torch.Tensor:
        return self.weightHAL("lm_head.weight" if self.M.has("lm_head.weight") else "model.embed_tokens.weight")

    def tokenHALOutput(self, id: int, pos: int, mode: int):
        be = self.Backend
        scale = 1.0 / math.sqrt(HEAD_DIM)
        # the token's input, uploaded OUTSIDE the captured region
        x = self.uploadHostF32(self.M.embedRows()[id:id + 1], "activation", "hal-token-input")

        # CUDA-graph fast path: capture this token's whole op stream and launch it as ONE graph.
        canGraph = isinstance(be, cudaBackend)
        capturing = False
        if _variant == "bug":
            gate = canGraph and self.halStep >= 2       # "after warm-up": two tokens, whatever they ran
        else:
            gate = canGraph and mode != halNoLogits and self.halLogitsWarm
        if gate:
            capturing = be.GraphBegin()

        def step():
            for l in range(NUM_LAYERS):
                def p(s, l=l):
                    return layerName(l, s)
                xn = be.RMSNorm(x, self.weightHAL(p("input_layernorm.weight")), RMS_EPS)
                q = be.MatMul(self.matWeightHAL(p("self_attn.q_proj.weight")), xn)
                kRaw = be.MatMul(self.matWeightHAL(p("self_attn.k_proj.weight")), xn)
                v = be.MatMul(self.matWeightHAL(p("self_attn.v_proj.weight")), xn)
                q = be.RoPE(q, pos, NUM_HEADS, HEAD_DIM)
                k = be.RoPE(kRaw, pos, NUM_KV_HEADS, HEAD_DIM)
                self.halKV.AppendKV(l, kRaw, k, v, pos)
                attnOut = be.Attention(q, self.halKV, l, scale)
                be.AddInPlace(x, be.MatMul(self.matWeightHAL(p("self_attn.o_proj.weight")), attnOut))
                xn2 = be.RMSNorm(x, self.weightHAL(p("post_attention_layernorm.weight")), RMS_EPS)
                g = be.MatMul(self.matWeightHAL(p("mlp.gate_proj.weight")), xn2)
                u = be.MatMul(self.matWeightHAL(p("mlp.up_proj.weight")), xn2)
                be.AddInPlace(x, be.MatMul(self.matWeightHAL(p("mlp.down_proj.weight")), be.SwiGLU(g, u)))
            if mode == halNoLogits:
                return x                                # prompt ingestion stops before the logits path
            finalNorm = self.weightHAL("model.norm.weight")
            hidden = be.RMSNorm(x, finalNorm, RMS_EPS)
            return be.MatMul(self.lmHeadHAL(), hidden)

        if capturing:
            g, out = capture(step, device=be.device, warmups=0, name=f"fak token {self.halStep} (pos {pos})",
                             owner="fak cudaBackend (per-token graph)", state=self.halKV.buffers())
            out = be.GraphEndLaunch(g, out)
        else:
            out = step()
        # finishGraph
        be.Free(x)               # per-token input/residual buffer; weights and KV are owned elsewhere
        self.halStep += 1
        if _variant == "fix" and mode != halNoLogits:
            self.halLogitsWarm = True                   # the logits path's weights and sizes are pooled now
        return None if mode == halNoLogits else out

    def tokenHAL(self, id: int, pos: int) -> torch.Tensor:
        logits = self.tokenHALOutput(id, pos, halFullLogits)
        out = self.Backend.Read(logits)
        self.recycleHALToken()
        return out

    def tokenHALNoLogits(self, id: int, pos: int) -> None:
        self.tokenHALOutput(id, pos, halNoLogits)
        self.recycleHALToken()

    def recycleHALToken(self) -> None:
        self.Backend.Recycle()   # token boundary: transients back to the pool

    def prefillHAL(self, ids: list[int], wantLogits: bool):
        last = len(ids) - 1
        for i, id in enumerate(ids):
            if i == last and wantLogits:
                return self.tokenHAL(id, self.halKV.Len())
            self.tokenHALNoLogits(id, self.halKV.Len())
        return None

    def Prefill(self, ids: list[int]) -> torch.Tensor:
        return self.prefillHAL(ids, True)

    def Step(self, id: int) -> torch.Tensor:
        return self.token(id, self.halKV.Len())

    def token(self, id: int, pos: int) -> torch.Tensor:
        return self.tokenHAL(id, pos)


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant

    def serve(graphs: bool):
        EnableCUDAGraph(graphs)          # FAK_CUDA_GRAPH=1 / --cuda-graph
        try:
            s = Session.NewBackendSession(Model(device), cudaBackend(device))
            logits = s.Prefill(PROMPT)
            outs = [logits]
            for _ in range(NEW_TOKENS):
                logits = s.Step(int(torch.argmax(logits)))
                outs.append(logits)
            return outs
        finally:
            EnableCUDAGraph(False)

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
