"""ggml-cann builds its RoPE sin/cos cache lazily, with a device allocation and a host-to-device copy of a malloc'd staging array; when the first RoPE evaluation falls inside an ACL graph capture, that copy is refused and the capture fails.

Upstream: https://github.com/ggml-org/llama.cpp/pull/20747 ("CANN: add RoPE cache preload before ACL graph capture",
noemotiovon / Chenguang Li, merged; synced to ggml as ggml-org/ggml@e312a9cd on 2026-03-23). No issue is linked. The
lazily built, grow-only cache came with https://github.com/ggml-org/llama.cpp/pull/15912 ("CANN: Add ROPE sin/cos
cache for reuse"); ACL graph capture with https://github.com/ggml-org/llama.cpp/pull/15065.
Symptom: with ACL graphs on (USE_ACL_GRAPH build, ``GGML_CANN_ACL_GRAPH`` on) and flash attention off (or
``GGML_CANN_PREFILL_USE_GRAPH=1``), the first ggml graph, the prompt's prefill, is captured, and the capture fails
(ACL error from ``ACL_CHECK``: a host-to-device memcpy and device malloc on the captured stream). The commit message:
"ACL graph capture disallows host-to-device memcpy and device memory malloc/free on the captured stream". With ACL
graphs off (op-by-op evaluation) the same model runs correctly.
Mechanism: ``ggml_backend_cann_graph_compute`` (``ggml/src/ggml-cann/ggml-cann.cpp``) resets
``rope_cache.cached = false`` and, when the LRU cache (``find_and_move_to_front``) holds no matching ACL graph,
pushes a new one and calls ``evaluate_and_capture_cann_graph``, which opens ``aclmdlRICaptureBegin`` and evaluates
every node on the captured stream. The first ROPE node reaches ``aclnn_rope_cache_init`` (``aclnn_ops.cpp``, via
``ggml_cann_rope``). Its Step 1.1 rebuilds the theta-scale exponent whenever ``theta_scale_length``, ``theta_scale`` or
``indep_sects`` differ from the cache's metadata, and on the first evaluation ever they do (the metadata starts at 0):
it ``malloc``s ``theta_scale_exp_host``, fills ``theta_scale^i`` on the CPU, ``aclrtMalloc``s
``theta_scale_cache`` and ``aclrtMemcpyAsync(..., ACL_MEMCPY_HOST_TO_DEVICE, ctx.stream())`` from the pageable
staging array -- on the capturing stream. (Step 5 then grows ``sin_cache``/``cos_cache`` with ``aclrtFree`` /
``aclrtMalloc`` when ``position_length`` exceeds the cache's.) The runtime refuses the copy and the capture fails.
The prefill exclusion of #15933 (no graph when the FLASH_ATTN_EXT node's Q has more than one token) cannot help when
the graph has no FLASH_ATTN_EXT node, so the prefill is captured and is the first RoPE evaluation of the process.
Evaluated op by op, the same init runs with nothing captured and later ROPE nodes hit the cache.
I read the pre-fix code (``aclnn_rope_cache_init``, ``ggml_backend_cann_graph_compute``, ``common.h``'s
``ggml_cann_rope_cache``) to choose between the two failures the lead names: it is the refused capture. Replays
cannot freeze capture-time positions before the fix, because ``ggml_backend_cann_graph_compute`` resets ``cached``
at every call, so the first ROPE of every captured graph records the position multiply, sin/cos and repeat kernels.
The fix's own ``cached = false`` after the preload keeps it so.
Doctor: sync-in-capture, at aclnn_rope_cache_init. A host-to-device copy from pageable (malloc'd) host memory, which
the stream must wait for and a capture cannot record, is issued while the ACL graph capture is open. The bug lives
in ``aclnn_rope_cache_init``: its lazy rebuild issues the allocation and the copy on whatever stream evaluates the
first ROPE, captured or not. The fix leaves that function as it is and changes its caller's context so that the
rebuild never happens inside a capture.
Fix (upstream): a new ``ggml_cann_rope_cache_preload(ctx, dst)`` parses the ROPE node's op_params as
``ggml_cann_rope`` does and runs the whole ``aclnn_rope_cache_init`` on the stream with nothing captured (H2D copies,
aclrtMalloc/Free, sin/cos), then sets ``ctx.rope_cache.cached = false``. The metadata stays set, so the capture skips
the copy and allocation branches but still records the on-device sin/cos kernels.
``ggml_backend_cann_graph_compute`` calls it on the first ROPE node (then ``break``) right after pushing a new ACL
graph, before the capture. ``common.h``'s node-property match now also compares ROPE ``op_params``.
Modelled: a 2-layer decoder fed embeddings (``inp_embd``) and positions (``inp_pos``), with head_dim 4 and 2 heads.
Each layer's Q and K are ``ggml_rope_ext`` (NEOX mode, freq_base 10000, no YaRN, freq_scale 1, no freq_factors), and
their sum goes back into the residual through ``wo``. Attention and the KV cache are left out, FA is off. Each layer
has two ROPE nodes. Only the first of the graph builds sin/cos into ``sin_cache``/``cos_cache``; the others find
``cached`` and the same metadata, and read the cache. A ggml graph per token count is the LRU's key; its leafs and
nodes keep their addresses. The LRU's property match is reduced to that key, so the ROPE op_params clause of the fix
is not exercised: one model, one RoPE setting. ``aclnn_rope_cache_init`` keeps Steps 1.1, 3, 4, 5 and 6 for this
setting. The yarn ramp, the mrope select index, freq_factors and the 310P path are left out. ``aclrtMalloc`` is
``torch.empty`` on the device. The malloc'd staging array is pageable host memory (``host(...).clone()``), and
``aclrtMemcpyAsync`` is a non-blocking ``copy_``. ``aclrtFree`` drops the reference. The ACL capture is the kit's
capture with no warmup, and ``aclmdlRIExecuteAsync`` after it is a replay. The workload is a 5-token prefill then 4
decode steps, with graphs (bug or fix) and with ACL graphs off (eager).
"""
from __future__ import annotations

import math

import torch

from workbench.engine import host
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/20747"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "aclnn_rope_cache_init"
SYMPTOM = ("ACL graph capture of the first ggml graph fails: the CANN RoPE cache's lazy init aclrtMallocs its "
           "theta-scale cache and copies the malloc'd host staging array host-to-device on the captured stream")

GGML_OP_MUL_MAT, GGML_OP_ROPE, GGML_OP_ADD, GGML_OP_FLASH_ATTN_EXT = "MUL_MAT", "ROPE", "ADD", "FLASH_ATTN_EXT"
GGML_ROPE_TYPE_NEOX = 2
N_LAYER, N_HEAD, HEAD_DIM, N_VOCAB = 2, 2, 4, 6
N_EMBD = N_HEAD * HEAD_DIM
FREQ_BASE = 10000.0
PROMPT, DECODE_STEPS = 5, 4


# --- ggml/src/ggml-cann/common.h ------------------------------------------------------------------------------

class ggml_cann_rope_cache:
    def __init__(self):
        # memory cache, prepare before inferencing.
        self.theta_scale_cache = None          # device, theta_scale_length floats
        self.theta_scale_exp_host = None       # malloc'd host staging array
        # sin/cos cache, used only to accelerate first layer on each device
        self.sin_cache = None
        self.cos_cache = None
        # Properties to check before reusing the sincos cache
        self.theta_scale_length = 0
        self.position_length = 0
        self.cached = False
        self.theta_scale = 0.0
        self.freq_scale = 0.0
        self.attn_factor = 0.0
        self.is_neox = False

    def equal(self, theta_scale_length, position_length, theta_scale, freq_scale, attn_factor, is_neox):
        return (self.theta_scale_length == theta_scale_length and self.position_length == position_length
                and self.theta_scale == theta_scale and self.freq_scale == freq_scale
                and self.attn_factor == attn_factor and self.is_neox == is_neox)

    def set(self, theta_scale_length, position_length, theta_scale, freq_scale, attn_factor, is_neox):
        self.theta_scale_length, self.position_length = theta_scale_length, position_length
        self.theta_scale, self.freq_scale, self.attn_factor, self.is_neox = theta_scale, freq_scale, attn_factor, is_neox


class ggml_tensor:
    def __init__(self, op, src, op_params=None, name=""):
        self.op, self.src, self.op_params, self.name = op, src, op_params or {}, name
        self.data = None
        self.ne = None


class ggml_cann_graph:
    def __init__(self, key):
        self.key = key
        self.graph = None             # (aclmdlRI, outputs)


class ggml_cann_graph_lru_cache:
    def __init__(self):
        self.cache_list: list[ggml_cann_graph] = []

    def find_and_move_to_front(self, cgraph) -> bool:
        for i, g in enumerate(self.cache_list):
            if g.key == cgraph.key:   # ggml_graph_node_has_matching_properties over every node (reduced)
                self.cache_list.insert(0, self.cache_list.pop(i))
                return True
        return False

    def push(self, new_graph):
        self.cache_list.insert(0, new_graph)


class ggml_backend_cann_context:
    def __init__(self, device, acl_graph_mode):
        self.device, self.acl_graph_mode = device, acl_graph_mode
        self.rope_cache = ggml_cann_rope_cache()
        self.graph_lru_cache = ggml_cann_graph_lru_cache()


# --- ggml/src/ggml-cann/aclnn_ops.cpp ---------------------------------------------------------------------------

def aclnn_rope_cache_init(ctx, dst, theta_scale, freq_scale, attn_factor, is_neox, rope_dims):
    src1 = dst.src[1]                 # position
    theta_scale_length = rope_dims // 2
    position_length = dst.ne[0]
    device = ctx.device

    if ctx.rope_cache.cached and ctx.rope_cache.equal(theta_scale_length, position_length, theta_scale, freq_scale,
                                                      attn_factor, is_neox):
        return                        # use cache.

    # Step1.1: prepare theta_scale exponent. if this exponent updated, should update theta_scale_tensor.
    if ctx.rope_cache.theta_scale_length != theta_scale_length or ctx.rope_cache.theta_scale != theta_scale:
        exps = [1.0]
        for _ in range(1, theta_scale_length):
            exps.append(exps[-1] * theta_scale)
        # theta_scale_exp_host = (float *) malloc(...), filled on the CPU: pageable host memory
        ctx.rope_cache.theta_scale_exp_host = host(torch.tensor(exps, dtype=torch.float32), device).clone()
        ctx.rope_cache.theta_scale_cache = None                                     # aclrtFree
        ctx.rope_cache.theta_scale_cache = torch.empty(theta_scale_length, device=device)   # aclrtMalloc
        # aclrtMemcpyAsync(theta_scale_cache, ..., theta_scale_exp_host, ..., ACL_MEMCPY_HOST_TO_DEVICE, ctx.stream())
        ctx.rope_cache.theta_scale_cache.copy_(ctx.rope_cache.theta_scale_exp_host, non_blocking=True)
    theta_scale_tensor = ctx.rope_cache.theta_scale_cache.view(1, theta_scale_length)

    # Step3: prepare position_tensor (auto bcast); Step4: multiply by the position
    position_tensor = src1.data.view(position_length, 1)
    theta = position_tensor * theta_scale_tensor                                   # aclnn_mul -> float

    # Step5: calculate sin cos. init sin_repeat && cos_repeat (grow-only)
    if position_length > ctx.rope_cache.position_length:
        ctx.rope_cache.position_length = position_length
        ctx.rope_cache.sin_cache = None                                            # aclrtFree
        ctx.rope_cache.cos_cache = None
        repeat_theta_length = theta_scale_length * position_length * 2
        ctx.rope_cache.sin_cache = torch.empty(repeat_theta_length, device=device)  # aclrtMalloc
        ctx.rope_cache.cos_cache = torch.empty(repeat_theta_length, device=device)
    sin = torch.sin(theta)
    cos = torch.cos(theta)
    if attn_factor != 1:
        sin = sin * attn_factor
        cos = cos * attn_factor

    # Step 6: repeat (NEOX: [sin th1..thn, sin th1..thn])
    n = position_length * rope_dims
    ctx.rope_cache.sin_cache[:n].view(position_length, rope_dims).copy_(sin.repeat(1, 2))
    ctx.rope_cache.cos_cache[:n].view(position_length, rope_dims).copy_(cos.repeat(1, 2))

    # Update cached value.
    ctx.rope_cache.cached = True
    ctx.rope_cache.set(theta_scale_length, position_length, theta_scale, freq_scale, attn_factor, is_neox)


def _rope_params(dst):
    n_dims, mode = dst.op_params["n_dims"], dst.op_params["mode"]
    freq_base, freq_scale, attn_factor = dst.op_params["freq_base"], dst.op_params["freq_scale"], \
        dst.op_params["attn_factor"]
    theta_scale = math.pow(freq_base, -2.0 / n_dims)
    is_neox = bool(mode & GGML_ROPE_TYPE_NEOX)
    return theta_scale, freq_scale, attn_factor, is_neox, n_dims


def ggml_cann_rope(ctx, dst):
    src0 = dst.src[0]                 # input [n_tokens, n_head, head_dim]
    theta_scale, freq_scale, attn_factor, is_neox, rope_dims = _rope_params(dst)
    # init ctx.rope_cos/rope_sin cache
    aclnn_rope_cache_init(ctx, dst, theta_scale, freq_scale, attn_factor, is_neox, rope_dims)

    ne02 = src0.data.shape[0]
    sin = ctx.rope_cache.sin_cache[:ne02 * rope_dims].view(ne02, 1, rope_dims)
    cos = ctx.rope_cache.cos_cache[:ne02 * rope_dims].view(ne02, 1, rope_dims)
    x = src0.data
    half = rope_dims // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    dst.data = x * cos + rotated * sin        # aclnnRotaryPositionEmbedding(mode 0: half)


def ggml_cann_rope_cache_preload(ctx, dst):
    """#20747: run the whole cache init with nothing captured, then let the capture record the on-device part."""
    theta_scale, freq_scale, attn_factor, is_neox, rope_dims = _rope_params(dst)
    aclnn_rope_cache_init(ctx, dst, theta_scale, freq_scale, attn_factor, is_neox, rope_dims)
    # Reset `cached` so that during graph capture the on-device computations (sin/cos, position multiply, repeat,
    # etc.) still execute and get recorded; the metadata remains set, so the H2D/malloc branches are skipped.
    ctx.rope_cache.cached = False


def ggml_cann_compute_forward(ctx, node):
    if node.op == GGML_OP_MUL_MAT:
        a, w = node.src
        node.data = (a.data.reshape(a.data.shape[0], -1) @ w.data).view(node.ne)
    elif node.op == GGML_OP_ROPE:
        ggml_cann_rope(ctx, node)
    elif node.op == GGML_OP_ADD:
        a, b = node.src
        node.data = a.data + b.data.reshape(a.data.shape)
    return True


# --- ggml/src/ggml-cann/ggml-cann.cpp ---------------------------------------------------------------------------

def evaluate_and_capture_cann_graph(cann_ctx, cgraph, use_cann_graph, cann_graph_capture_required):
    def evaluate():
        for node in cgraph.nodes:
            assert ggml_cann_compute_forward(cann_ctx, node)
        return cgraph.result_output.data

    if not use_cann_graph:
        return evaluate()
    matched_graph = cann_ctx.graph_lru_cache.cache_list[0]
    if cann_graph_capture_required:   # aclmdlRICaptureBegin(stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL) .. CaptureEnd
        matched_graph.graph = capture(evaluate, device=cann_ctx.device, warmups=0, name=f"acl graph n={cgraph.key}",
                                      owner="ggml_backend_cann_context",
                                      static={"inp_embd": cgraph.inp_embd.data, "inp_pos": cgraph.inp_pos.data})
    g, out = matched_graph.graph
    return replay(g, out)             # aclmdlRIExecuteAsync


def ggml_backend_cann_graph_compute(cann_ctx, cgraph, variant):
    # calculate rope cache for fist layer in current device.
    cann_ctx.rope_cache.cached = False

    graph_capture_required = False
    use_cann_graph = True
    prefill_use_graph = False         # GGML_CANN_PREFILL_USE_GRAPH unset
    if not prefill_use_graph:
        # Do not use acl_graph for prefill: only found through a FLASH_ATTN_EXT node (FA off: none).
        for node in cgraph.nodes:
            if node.op == GGML_OP_FLASH_ATTN_EXT:
                use_cann_graph = node.src[0].ne[0] == 1
                break
    if not cann_ctx.acl_graph_mode:
        use_cann_graph = False

    if use_cann_graph:
        graph_capture_required = not cann_ctx.graph_lru_cache.find_and_move_to_front(cgraph)
        if graph_capture_required:
            cann_ctx.graph_lru_cache.push(ggml_cann_graph(cgraph.key))
            if variant == "fix":      # #20747: pre-load rope cache before graph capture
                for node in cgraph.nodes:
                    if node.op == GGML_OP_ROPE:
                        ggml_cann_rope_cache_preload(cann_ctx, node)
                        break
    return evaluate_and_capture_cann_graph(cann_ctx, cgraph, use_cann_graph, graph_capture_required)


# --- llama.cpp: the model's graph (one per token count; ggml-alloc keeps its addresses) --------------------------

class llm_graph:
    def __init__(self, model, n_tokens, device):
        self.key = n_tokens
        self.inp_embd = ggml_tensor(None, [], name="inp_embd")
        self.inp_embd.data = torch.zeros(n_tokens, N_EMBD, device=device)
        self.inp_pos = ggml_tensor(None, [], name="inp_pos")
        self.inp_pos.data = torch.zeros(n_tokens, dtype=torch.int32, device=device)
        rope_params = {"n_dims": HEAD_DIM, "mode": GGML_ROPE_TYPE_NEOX, "freq_base": FREQ_BASE,
                       "freq_scale": 1.0, "attn_factor": 1.0}
        self.nodes = []

        def add(op, src, ne, name, op_params=None):
            t = ggml_tensor(op, src, op_params, name)
            t.ne = ne
            self.nodes.append(t)
            return t

        inpL = self.inp_embd
        for il in range(N_LAYER):
            qcur = add(GGML_OP_MUL_MAT, [inpL, model[f"wq.{il}"]], (n_tokens, N_HEAD, HEAD_DIM), f"Qcur-{il}")
            qcur = add(GGML_OP_ROPE, [qcur, self.inp_pos], (n_tokens, N_HEAD, HEAD_DIM), f"Qcur-{il}", rope_params)
            kcur = add(GGML_OP_MUL_MAT, [inpL, model[f"wk.{il}"]], (n_tokens, N_HEAD, HEAD_DIM), f"Kcur-{il}")
            kcur = add(GGML_OP_ROPE, [kcur, self.inp_pos], (n_tokens, N_HEAD, HEAD_DIM), f"Kcur-{il}", rope_params)
            qk = add(GGML_OP_ADD, [qcur, kcur], (n_tokens, N_HEAD, HEAD_DIM), f"qk-{il}")
            attn_out = add(GGML_OP_MUL_MAT, [qk, model[f"wo.{il}"]], (n_tokens, N_EMBD), f"attn_out-{il}")
            inpL = add(GGML_OP_ADD, [inpL, attn_out], (n_tokens, N_EMBD), f"l_out-{il}")
        self.result_output = add(GGML_OP_MUL_MAT, [inpL, model["output"]], (n_tokens, N_VOCAB), "result_output")


def _weights(device):
    gen = generator(20747)
    model = {}
    for il in range(N_LAYER):
        for w, scale in (("wq", 0.5), ("wk", 0.5), ("wo", 0.3)):
            t = ggml_tensor(None, [], name=f"{w}.{il}")
            t.data = randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=scale)
            model[f"{w}.{il}"] = t
    out = ggml_tensor(None, [], name="output")
    out.data = randn(N_EMBD, N_VOCAB, gen=gen, device=device, scale=0.5)
    model["output"] = out
    return model


def run(variant: str, device: str = "cpu"):
    gen = generator(1)
    ubatches = [(randn(PROMPT, N_EMBD, gen=gen, device=device), list(range(PROMPT)))]
    for i in range(DECODE_STEPS):
        ubatches.append((randn(1, N_EMBD, gen=gen, device=device), [PROMPT + i]))

    def serve(acl_graph_mode: bool):
        model = _weights(device)
        cann_ctx = ggml_backend_cann_context(device, acl_graph_mode)
        graphs: dict[int, llm_graph] = {}
        outs = []
        for embd, pos in ubatches:    # llama_decode: prompt, then one token at a time
            n_tokens = embd.shape[0]
            cgraph = graphs.setdefault(n_tokens, llm_graph(model, n_tokens, device))
            cgraph.inp_embd.data.copy_(embd)                                      # ggml_backend_tensor_set
            cgraph.inp_pos.data.copy_(torch.tensor(pos, dtype=torch.int32))
            out = ggml_backend_cann_graph_compute(cann_ctx, cgraph, variant)
            outs.append(out.clone())                                              # ggml_backend_tensor_get
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
