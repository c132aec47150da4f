"""rwkv_lightning's single-sequence server (``single_infer.py``, RWKV-7) captured one CUDA graph of the one-token
decode step at start-up (``initialize_cuda_graph``), on module-global static buffers: the token embedding
``static_input_global``, the three recurrent-state tensors ``static_state_global`` (token-shift ``x_prev``, the WKV
state, the step counter ``elapsed_t``) and the logits ``static_output_global``. Every streamed request
(``single_infer_stream``, an async generator that does ``await asyncio.sleep(0)`` after each token) prefilled its
prompt eagerly on its own state, copied that state and its first token into the global buffers and replayed the one
graph. Eager decoding updates each request's own state tensors; under the graph, two streams in flight at once share
one state: a request that starts copies its state over the state another request is decoding from, and from then on
the two streams' replays advance one recurrent state with their tokens in turn, each reading the state and the token
the other one's step left in the buffers. Both requests stream wrong text. The fix gives every request its own
graph and static buffers (``create_request_graph``), captured when the request starts.

Upstream: https://github.com/RWKV-Vibe/rwkv_lightning/commit/9cdd0fc8d061b1b389b70c5b18bec7bea7b09dcd
("Fix synchronous cuda graph erro", repository RWKV-Vibe/rwkv_lightning (then Alic-Li's), author alic-li,
2025-11-29, pushed to main; I found no pull request or issue for it). Read, in a mirror of the repository: the whole
diff of 9cdd0fc (``single_infer.py`` only: ``initialize_cuda_graph`` -> ``initialize_cuda_graph_template``, which
keeps only shapes; the new ``create_request_graph``; ``generate_single`` and ``single_infer_stream`` taking their own
graph and falling back to an eager loop when it is None); ``single_infer.py`` whole at its parent 85e1406; the commit
that made the graph global, 0b2c46f ("Fix recompile cuda graph", 2025-11-11: before it each request allocated, warmed
up and captured its own graph inside ``generate_single``/``single_infer_stream``), and a2b3653 (first-token change,
not a graph change); at 85e1406, ``rwkv_batch/rwkv7.py`` (``RWKV_x070``: ``generate_zero_state``, ``forward``,
``forward_one``, ``forward_seq``, ``RWKV_x070_TMix_one``, ``RWKV_x070_CMix_one``, ``WKV_7_ONE``/``RWKV7_ONE_OP``; the
state is updated in place: ``x_prev[0] = x``, ``x_prev[1] = x``, the CUDA op writes the WKV state, ``state[2] += 1``),
``kernel_forward_w0_fp16_dither_one`` in ``rwkv_batch/cuda/rwkv7_state_fwd_fp16.cu`` (the one-token WKV update with
its ``rotator1(elapsed_t)`` dither of the decay) and ``sampler_simple`` in ``rwkv_batch/utils.py``.
Not read: Robyn's ``StreamingResponse`` (I assume, without having read it, that it iterates each response's async
generator on the server's one event loop, so that two streams interleave at ``await asyncio.sleep(0)``), any report
of the symptom (I found none: the commit message is all; I read "synchronous" as "concurrent", which the code
supports), the later history of the file beyond the list of commits, the HIP kernels, ``main_robyn.py``'s batch
graphs, and ``rwkv_mm_sparsity``/``SPMV`` beyond their signatures.
Symptom: no report; the commit title is "Fix synchronous cuda graph erro". From the code: with two ``stream: true``
requests to ``/v4/chat/completions`` in flight, both stream tokens decoded from one shared recurrent state once the
second has started (its own first step is right: it copies its state in first), so both answers are garbled; one
request at a time is right. Non-stream requests (``generate_single``, run in a thread pool under ``model_lock``)
shared the same buffers with the streams; not modelled.
Mechanism: the global graph reads ``static_input_global`` and ``static_state_global`` by address. Request A
(prompt, prefill, copy its state and first token in, replay, sample, copy the next token's embedding in,
``await asyncio.sleep(0)``) is suspended; request B starts, prefills on its own zero state, and copies its state and
token into the same buffers, overwriting A's state; B replays and writes its next token. When A resumes it replays
on B's token and B's advanced state, and writes its own token, which B's next replay reads, and so on: each step of
either request reads what the other's step left in the buffers. Without graphs ``model.forward(x, state)`` updates
the request's own ``state`` list, and interleaving changes nothing.
Doctor: stale-input, at ``single_infer_stream``: a request's replay reads static inputs (the recurrent state and the
token buffer) whose values its own step did not write: they are what the other request's step left there. The
defect is decided in ``single_infer_stream``: it binds the request to the process-global graph and buffers
(``global static_graph, static_input_global, static_state_global, ...``) where the fix makes it call
``create_request_graph()`` for a graph and buffers of its own; it is the function the fix rewrites (with
``generate_single``). Not overwritten-output: nothing reads a handed-out output after the next replay (the logits are
cloned at once); the state the other request's copy and replay overwrite is this request's next input.
Fix (upstream): ``initialize_cuda_graph_template`` records only the shapes at start-up; ``create_request_graph``
runs an eager forward on a zero state (for dtypes), allocates the request's own ``static_input``, ``static_state``
and ``static_output``, warms up once and captures a new ``torch.cuda.CUDAGraph`` on them; ``single_infer_stream``
copies its state and token into its own buffers, replays its own graph, deletes them at the end, and runs
``model.forward`` eagerly when no graph could be made.
Modelled: ``RWKV_x070`` (``generate_zero_state(0)``, ``forward``, ``forward_one``, ``forward_seq``, ``z`` with
``emb.weight`` layer-normed by ``ln0``), ``RWKV_x070_TMix_one`` (token shift, the r/w/k/v/a/g projections with the
low-rank w/a/v/g paths, ``k_k``/``k_a``/``r_k``, ``v_first`` blending, ``group_norm``), ``RWKV7_ONE_OP`` (the
kernel's update ``s += s*w + k*v + (a.s)*b`` with ``w = exp(-e^-0.5 sigmoid(w)) - 1 + rotator1(elapsed_t)``),
``RWKV_x070_CMix_one``, ``sampler_simple``; from ``single_infer.py``: ``initialize_cuda_graph`` (bug),
``initialize_cuda_graph_template`` and ``create_request_graph`` (fix), ``single_infer_stream``, and the globals
``static_graph``, ``static_input_global``, ``static_state_global``, ``static_output_global``, ``graph_initialized``
(attributes of ``SingleInferServer``, which stands for the module).
Stand-ins: the model is mine: 2 layers, width 16 (2 heads of 8), FFN 64, low-rank widths 4, vocabulary 24,
float64 (upstream fp16 and head size 64); ``rwkv_mm_sparsity`` is a plain matmul; ``forward_seq`` runs the prompt
one token at a time through ``forward_one`` (the sequence kernel computes the same recurrence, with
``rotator1(elapsed_t + t)`` and ``elapsed_t += T``). Prompts are token ids (no tokenizer); the stream yields chunks
of token ids where upstream yields JSON of the decoded text, and hands each step's logits to a list the workload
keeps. Greedy sampling (``noise=0``; upstream's default noise is 1.5). The event loop is ``asyncio`` running the two
clients; request B arrives two event-loop turns after A. The run without graphs is the fix's eager fallback branch
(the same ``single_infer_stream`` when no graph exists), used for both variants; before the fix the function had
no such branch.
Workload: start-up (``initialize_cuda_graph`` on an example prompt, bug only); request A (prompt 3 17 5 9 1) and
request B (prompt 8 2 20 11), ``max_tokens`` 7 each, ``stop_tokens`` [0], ``chunk_size`` 4, streamed concurrently.
Outputs: per request, the 7 tokens (-1 after a stop) and the logits each token was sampled from (zeros after a stop).
Measured: the check printed
  rwkvlightning_9cdd0fc_concurrent_streams_share_global_graph_state [bug] on cpu: misbehaves (max |graph - eager| = 13)
  rwkvlightning_9cdd0fc_concurrent_streams_share_global_graph_state [fix] on cpu: equals eager (max |graph - eager| = 0)
Without graphs A streams 16 2 22 2 7 22 14 and B 19 15 1 14 11 7 12. With the bug A's first four tokens and B's
first two are right (B starts after A's third replay, from a clean copy of its own state); from then on the two
streams take turns decoding B's continuation: A gets 1 11 12 (B's third, fifth and seventh tokens), B gets 14 7
(its fourth and sixth) and then, alone, 14 14 14 (B streams 19 15 14 7 14 14 14). With the fix both equal the run
without graphs; with B arriving after A has finished, the bug equals it too. The check took about 3 s on the CPU.
"""
from __future__ import annotations

import asyncio
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.zoo.kit import capture, compare, generator, replay

UPSTREAM = "https://github.com/RWKV-Vibe/rwkv_lightning/commit/9cdd0fc8d061b1b389b70c5b18bec7bea7b09dcd"
FAMILY = "persistent-buffer mutation"
KIND = "stale-input"
SITE = "single_infer_stream"
SYMPTOM = ("two streamed requests in flight at once decoded through one process-global CUDA graph and its static "
           "input and recurrent-state buffers, so each request's replays read the state and token the other "
           "request's step left there and both streamed wrong tokens")

VOCAB, N_EMBD, HEAD_SIZE, N_LAYER, FFN = 24, 16, 8, 2, 64
N_HEAD = N_EMBD // HEAD_SIZE
D_LORA = 4
DTYPE = torch.float64
RO1 = -1640531527                      # (int)2654435769
TWO_TO_NEG_41 = 2.0 ** -41
_variant = "bug"


# --- model (rwkv_batch/rwkv7.py) ------------------------------------------------------------------------------------

def rotator1(elapsed_t: Tensor) -> Tensor:
    """``two_to_neg_41 * float(ro1 * elapsed_t)`` with the product wrapped to 32 bits, as the kernel computes it."""
    p = elapsed_t.to(torch.int64) * RO1
    p = torch.remainder(p + 2 ** 31, 2 ** 32) - 2 ** 31
    return p.to(DTYPE) * TWO_TO_NEG_41


def RWKV7_ONE_OP(state: Tensor, r, w, k, v, a, b, elapsed_t: Tensor) -> Tensor:
    """``kernel_forward_w0_fp16_dither_one``: updates ``state`` [H, N, N] (row = value index) in place."""
    H, N = N_HEAD, HEAD_SIZE
    w = torch.exp(-math.exp(-0.5) * torch.sigmoid(w)) - 1.0 + rotator1(elapsed_t)
    r, w, k, v, a, b = (t.view(H, N) for t in (r, w, k, v, a, b))
    sa = (state * a[:, None, :]).sum(-1, keepdim=True)                       # [H, N, 1]
    new = state + state * w[:, None, :] + v[:, :, None] * k[:, None, :] + sa * b[:, None, :]
    state.copy_(new)
    return (new * r[:, None, :]).sum(-1).view(H * N)


def RWKV_x070_TMix_one(layer_id: int, H: int, N: int, x, x_prev, v_first, state, x_r, x_w, x_k, x_v, x_a, x_g,
                       w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k, R_, K_, V_, O_, ln_w, ln_b,
                       elapsed_t):
    xx = x_prev[0] - x
    x_prev[0] = x
    xr, xw, xk, xv, xa, xg = x + xx * x_r, x + xx * x_w, x + xx * x_k, x + xx * x_v, x + xx * x_a, x + xx * x_g

    r = F.linear(xr, R_)
    w = F.linear(torch.tanh(F.linear(xw, w1)), w2, bias=w0)
    k = F.linear(xk, K_)
    v = F.linear(xv, V_)
    a = torch.sigmoid(F.linear(F.linear(xa, a1), a2, bias=a0))
    g = F.linear(torch.sigmoid(F.linear(xg, g1)), g2)
    kk = F.normalize((k * k_k).view(H, N), dim=-1, p=2.0).view(H * N)
    k = k * (1 + (a - 1) * k_a)
    kka = kk * a

    if layer_id == 0:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(F.linear(F.linear(xv, v1), v2, bias=v0))

    xx = RWKV7_ONE_OP(state, r, w, k, v, -kk, kka, elapsed_t)   # !!! modifies state in-place !!!

    xx = F.group_norm(xx.view(1, H * N), num_groups=H, weight=ln_w, bias=ln_b, eps=64e-5).view(H * N)
    xx = xx + ((r * k * r_k).view(H, N).sum(dim=-1, keepdim=True) * v.view(H, N)).view(H * N)
    return F.linear((xx * g), O_), v_first


def RWKV_x070_CMix_one(x, x_prev, x_k, K_, V_):
    xx = x_prev[1] - x
    x_prev[1] = x
    k = x + xx * x_k
    k = torch.relu(F.linear(k, K_)) ** 2
    return k @ V_                                   # (stand-in) rwkv_mm_sparsity(k, V_)


class RWKV_x070:
    def __init__(self, device):
        gen = generator(1)
        C, D = N_EMBD, D_LORA

        def w(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen, dtype=DTYPE) * scale + shift).to(device)

        z = {"emb.weight": w(VOCAB, C), "blocks.0.ln0.weight": w(C, scale=0.1, shift=1.0),
             "blocks.0.ln0.bias": w(C, scale=0.1)}
        for i in range(N_LAYER):
            att, ffn, bbb = f"blocks.{i}.att.", f"blocks.{i}.ffn.", f"blocks.{i}."
            for n in ("ln1", "ln2"):
                z[bbb + n + ".weight"], z[bbb + n + ".bias"] = w(C, scale=0.1, shift=1.0), w(C, scale=0.1)
            for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
                z[att + n] = torch.rand(C, generator=gen, dtype=DTYPE).to(device)
            z[att + "w0"], z[att + "w1"], z[att + "w2"] = w(C, scale=0.5), w(D, C, scale=C ** -0.5), w(C, D, scale=0.5)
            z[att + "a0"], z[att + "a1"], z[att + "a2"] = w(C, scale=0.5), w(D, C, scale=C ** -0.5), w(C, D, scale=0.5)
            z[att + "v0"], z[att + "v1"], z[att + "v2"] = w(C, scale=0.5), w(D, C, scale=C ** -0.5), w(C, D, scale=0.5)
            z[att + "g1"], z[att + "g2"] = w(D, C, scale=C ** -0.5), w(C, D, scale=0.5)
            z[att + "k_k"], z[att + "k_a"] = w(C, scale=0.2, shift=1.0), w(C, scale=0.2, shift=1.0)
            z[att + "r_k"] = w(C, scale=0.3)
            for n in ("receptance", "key", "value", "output"):
                z[att + n + ".weight"] = w(C, C, scale=C ** -0.5)
            z[att + "ln_x.weight"], z[att + "ln_x.bias"] = w(C, scale=0.1, shift=1.0), w(C, scale=0.1)
            z[ffn + "x_k"] = torch.rand(C, generator=gen, dtype=DTYPE).to(device)
            z[ffn + "key.weight"], z[ffn + "value.weight"] = w(FFN, C, scale=C ** -0.5), w(FFN, C, scale=FFN ** -0.5)
        z["ln_out.weight"], z["ln_out.bias"] = w(C, scale=0.1, shift=1.0), w(C, scale=0.1)
        z["head.weight"] = w(VOCAB, C, scale=2.0 * C ** -0.5)
        z["emb.weight"] = F.layer_norm(z["emb.weight"], (C,), weight=z["blocks.0.ln0.weight"],
                                       bias=z["blocks.0.ln0.bias"])
        self.z, self.device = z, device
        self.n_layer, self.n_embd, self.n_head, self.head_size = N_LAYER, C, N_HEAD, HEAD_SIZE

    def generate_zero_state(self, bsz: int) -> list:
        assert bsz == 0                                      # (the single-sequence layout)
        return [torch.zeros((self.n_layer, 2, self.n_embd), dtype=DTYPE, device=self.device),
                torch.zeros((self.n_layer, self.n_head, self.head_size, self.head_size), dtype=DTYPE,
                            device=self.device),
                torch.zeros((), dtype=torch.int32, device=self.device)]

    def forward(self, idx, state: list) -> Tensor:           # will modify state in-place
        if type(idx) is list:
            if len(idx) > 1:
                return self.forward_seq(idx, state)
            return self.forward_one(self.z["emb.weight"][idx[0]], state)
        if type(idx) is torch.Tensor:
            return self.forward_one(idx, state)
        return self.forward_one(self.z["emb.weight"][idx], state)

    def forward_one(self, x: Tensor, state: list) -> Tensor:
        z = self.z
        v_first = torch.empty_like(x)
        for i in range(self.n_layer):
            bbb, att, ffn = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
            xx = F.layer_norm(x, (self.n_embd,), weight=z[bbb + "ln1.weight"], bias=z[bbb + "ln1.bias"])
            xx, v_first = RWKV_x070_TMix_one(
                i, self.n_head, self.head_size, xx, state[0][i], v_first, state[1][i],
                z[att + "x_r"], z[att + "x_w"], z[att + "x_k"], z[att + "x_v"], z[att + "x_a"], z[att + "x_g"],
                z[att + "w0"], z[att + "w1"], z[att + "w2"], z[att + "a0"], z[att + "a1"], z[att + "a2"],
                z[att + "v0"], z[att + "v1"], z[att + "v2"], z[att + "g1"], z[att + "g2"],
                z[att + "k_k"], z[att + "k_a"], z[att + "r_k"],
                z[att + "receptance.weight"], z[att + "key.weight"], z[att + "value.weight"],
                z[att + "output.weight"], z[att + "ln_x.weight"], z[att + "ln_x.bias"], state[2])
            x = x + xx
            xx = F.layer_norm(x, (self.n_embd,), weight=z[bbb + "ln2.weight"], bias=z[bbb + "ln2.bias"])
            xx = RWKV_x070_CMix_one(xx, state[0][i], z[ffn + "x_k"], z[ffn + "key.weight"], z[ffn + "value.weight"])
            x = x + xx
        x = F.layer_norm(x, (self.n_embd,), weight=z["ln_out.weight"], bias=z["ln_out.bias"])
        x = F.linear(x, z["head.weight"])
        state[2] += 1
        return x

    def forward_seq(self, idx: list, state: list) -> Tensor:
        """(stand-in) the sequence kernel's recurrence, one token at a time."""
        out = None
        for tok in idx:
            out = self.forward_one(self.z["emb.weight"][tok], state)
        return out


def sampler_simple(logits: Tensor, noise: float = 0.0) -> Tensor:
    """(rwkv_batch/utils.py) greedy when ``noise == 0``; modifies ``logits`` in place otherwise."""
    return torch.argmax(logits, dim=-1, keepdim=False)


# --- single_infer.py ------------------------------------------------------------------------------------------------

class SingleInferServer:
    """The module ``single_infer.py``: its globals are this object's attributes."""

    def __init__(self, model: RWKV_x070, device, use_cuda_graph: bool):
        self.model, self.device, self.use_cuda_graph = model, device, use_cuda_graph
        self.static_graph = None
        self.static_input_global = None
        self.static_state_global = [None, None, None]
        self.static_output_global = None
        self.graph_initialized = False
        self.graph_template_initialized = False
        self.template_input_shape = None
        self.n_requests = 0

    # -- bug: one graph for the process --
    def initialize_cuda_graph(self) -> None:
        model = self.model
        state = model.generate_zero_state(0)
        encoded_prompt = [1, 2, 3]                      # "User: hello\n\nAssistant:"
        out = model.forward(encoded_prompt, state)
        token = sampler_simple(out, noise=0).item()
        x = model.z["emb.weight"][token]

        self.static_input_global = torch.empty_like(x, device=self.device)
        self.static_state_global = [torch.empty_like(s, device=self.device) for s in state]
        static_input, static_state = self.static_input_global, self.static_state_global
        # static_output = model.forward(...) once eagerly, then the capture
        self.static_graph, self.static_output_global = capture(
            lambda: model.forward(static_input, static_state), device=self.device, warmups=1,
            name="single_infer global decode graph", owner="single_infer.py (module globals)",
            static={"static_input_global": static_input},
            state={f"static_state_global[{i}]": s for i, s in enumerate(static_state)})

        self.static_input_global.copy_(x)
        for i in range(3):
            self.static_state_global[i].copy_(state[i])
        self.graph_initialized = True

    # -- fix: a graph per request --
    def initialize_cuda_graph_template(self) -> None:
        model = self.model
        state = model.generate_zero_state(0)
        out = model.forward([1, 2, 3], state)
        token = sampler_simple(out, noise=0).item()
        self.template_input_shape = model.z["emb.weight"][token].shape
        self.graph_template_initialized = True

    def create_request_graph(self):
        if not self.graph_template_initialized:
            return None, None, None, None
        model = self.model
        example_state = model.generate_zero_state(0)
        example_x = model.z["emb.weight"][0]
        example_out = model.forward(example_x, example_state)
        static_input = torch.empty_like(example_x, device=self.device)
        static_state = [torch.empty_like(s, device=self.device) for s in example_state]
        del example_out
        self.n_requests += 1
        # warm up once, then capture a new graph on this request's own buffers
        static_graph, static_output = capture(
            lambda: model.forward(static_input, static_state), device=self.device, warmups=1,
            name=f"single_infer request graph {self.n_requests}",
            owner=f"single_infer.py create_request_graph (request {self.n_requests})",
            static={"static_input": static_input},
            state={f"static_state[{i}]": s for i, s in enumerate(static_state)})
        return static_graph, static_input, static_state, static_output

    async def single_infer_stream(self, prompt: list, max_tokens=50, stop_tokens=(0,), temperature=1.0, noise=0.0,
                                  chunk_size=32, record: list | None = None):
        model = self.model
        if _variant == "bug" and self.use_cuda_graph:
            static_graph, static_input = self.static_graph, self.static_input_global
            static_state, static_output = self.static_state_global, self.static_output_global
        else:
            static_graph, static_input, static_state, static_output = self.create_request_graph()

        state = model.generate_zero_state(0)
        out = model.forward(prompt, state)
        logits = out.clone()
        record.append(logits.clone())
        token = sampler_simple(logits, noise=noise).item()

        token_buffer = [token]
        finished = False
        if static_graph is not None:
            x = model.z["emb.weight"][token]
            static_input.copy_(x)
            for i in range(3):
                static_state[i].copy_(state[i])
            for _ in range(max_tokens - 1):
                out = replay(static_graph, static_output)
                logits = out.clone()
                record.append(logits.clone())
                token = sampler_simple(logits, noise=noise).item()
                if token in stop_tokens:
                    finished = True
                    if token_buffer:
                        yield list(token_buffer)
                        token_buffer.clear()
                    break
                token_buffer.append(token)
                if len(token_buffer) >= chunk_size:
                    yield list(token_buffer)
                    token_buffer.clear()
                x = model.z["emb.weight"][token]
                static_input.copy_(x)
                await asyncio.sleep(0)
        else:                                               # (the fix's eager fallback; the run without graphs)
            for _ in range(max_tokens - 1):
                x = model.z["emb.weight"][token]
                out = model.forward(x, state)
                logits = out.clone()
                record.append(logits.clone())
                token = sampler_simple(logits, noise=noise).item()
                if token in stop_tokens:
                    finished = True
                    if token_buffer:
                        yield list(token_buffer)
                        token_buffer.clear()
                    break
                token_buffer.append(token)
                if len(token_buffer) >= chunk_size:
                    yield list(token_buffer)
                    token_buffer.clear()
                await asyncio.sleep(0)
        if token_buffer and not finished:
            yield list(token_buffer)
        del state, static_graph, static_input, static_state, static_output


# --- the workload -----------------------------------------------------------------------------------------------------

REQUESTS = (([3, 17, 5, 9, 1], 0), ([8, 2, 20, 11], 2))      # (prompt, event-loop turns before it arrives)
MAX_TOKENS, STOP_TOKENS, CHUNK = 7, (0,), 4


async def _client(server: SingleInferServer, prompt: list, arrive_after: int, record: list, tokens: list) -> None:
    for _ in range(arrive_after):
        await asyncio.sleep(0)
    async for chunk in server.single_infer_stream(prompt, max_tokens=MAX_TOKENS, stop_tokens=STOP_TOKENS,
                                                  chunk_size=CHUNK, record=record):
        tokens.extend(chunk)


def serve(device, use_cuda_graph: bool) -> list:
    server = SingleInferServer(RWKV_x070(device), device, use_cuda_graph)
    if use_cuda_graph:                                       # if __name__ == "__main__": ...
        if _variant == "bug":
            server.initialize_cuda_graph()
        else:
            server.initialize_cuda_graph_template()
    records = [[] for _ in REQUESTS]
    tokens = [[] for _ in REQUESTS]

    async def main():
        await asyncio.gather(*(_client(server, p, d, records[i], tokens[i]) for i, (p, d) in enumerate(REQUESTS)))

    asyncio.run(main())
    outputs = []
    for rec, toks in zip(records, tokens):
        logits = torch.zeros(MAX_TOKENS, VOCAB, dtype=DTYPE, device=device)
        logits[:len(rec)] = torch.stack(rec)[:MAX_TOKENS]
        outputs.append(torch.tensor(toks + [-1] * (MAX_TOKENS - len(toks)), dtype=torch.long).to(device))
        outputs.append(logits)
    return outputs


def run(variant: str, device: str = "cpu"):
    global _variant
    _variant = variant
    return compare(__name__.rsplit(".", 1)[-1], variant, device,
                   lambda: serve(device, use_cuda_graph=True), lambda: serve(device, use_cuda_graph=False))
