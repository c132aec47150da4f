"""Another session's KV-cache clear syncs the whole device while this session's decode graph is being captured.

Upstream: https://github.com/ggml-org/llama.cpp/pull/14033 ("cuda : fix device sync on buffer clear", June 2025;
ggml-org/ggml@fd175573), follow-up https://github.com/ggml-org/llama.cpp/pull/14288 ("cuda : synchronize graph
capture and cublas handle destruction"); issues #13990 ("Abort is called in a thread from a custom thread pool during
a llama_decode call") and #11804 ("CUDA errors with multi-threaded use").
Symptom: several llama contexts served from one process's thread pool abort at random: one thread gets "CUDA error:
operation not permitted when stream is capturing", the decoding one "operation failed due to a previous error during
capture" in ``ggml_backend_cuda_graph_compute`` (``CUDA_CHECK`` aborts); ``GGML_CUDA_DISABLE_GRAPHS=1`` hides it.
Mechanism: session A's ``llama_decode`` reaches ``ggml_backend_cuda_graph_compute``; on its first step after the
warmup ``cuda_graph_update_required`` is set, so ``evaluate_and_capture_cuda_graph`` calls
``cudaStreamBeginCapture(cuda_ctx->stream(), cudaStreamCaptureModeRelaxed)``, evaluates every node into the capture,
``cudaStreamEndCapture`` and launches the graph (later steps only relaunch it). Meanwhile the pool's thread for
session B starts a new conversation: ``llama_kv_cache_unified::clear`` calls ``ggml_backend_buffer_clear`` on its KV
buffer, i.e. ``ggml_backend_cuda_buffer_clear``, which did ``cudaDeviceSynchronize(); cudaMemset(...);
cudaDeviceSynchronize();``. A device-wide sync waits for every stream of the device, A's capturing stream too: it is
refused and A's capture is invalidated. In the model the other thread's work runs where it lands
(``yield_to_other_threads``, called between A's node evaluations): its device-wide syncs run inside A's open capture,
where the engine refuses a synchronisation as CUDA does; what it does on its own per-thread stream runs on a real
thread of its own (``cudaStreamPerThread``), which A's capture never sees.
Doctor: sync-in-capture, at ``ggml_backend_cuda_buffer_clear`` (its ``cudaDeviceSynchronize`` lands inside session
A's capture of the decode graph).
Fix (upstream): #14033 makes ``ggml_backend_cuda_buffer_clear`` do ``cudaMemsetAsync(ctx->dev_ptr, value,
buffer->size, cudaStreamPerThread); cudaStreamSynchronize(cudaStreamPerThread);`` -- only the calling thread's stream
is waited for. (#14288 then guards the other such path, ``~ggml_backend_cuda_context``'s ``cublasDestroy``, with a
``ggml_cuda_lock`` / ``ggml_cuda_lock_cv`` / ``ggml_cuda_lock_counter`` that the capture increments and the
destructor waits on; that path is not modelled here.)
"""
from __future__ import annotations

import math
import threading

import torch

from workbench.engine import synchronize
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/ggml-org/llama.cpp/pull/14033"
FAMILY = "warmup/capture vs replay state"
KIND = "sync-in-capture"
SITE = "ggml_backend_cuda_buffer_clear"
SYMPTOM = "session A's decode-graph capture aborts: session B's KV-cache clear calls cudaDeviceSynchronize meanwhile"

N_CTX, N_EMBD, N_VOCAB, STEPS_A, STEPS_B, WARMUP = 6, 4, 9, 5, 3, 1

OTHER_THREADS: list = []             # work the thread pool's other sessions have handed in


def yield_to_other_threads():
    """The pool's other threads run now. While a capture is open here, their device-wide calls land in it."""
    while OTHER_THREADS:
        OTHER_THREADS.pop(0)()


def cudaDeviceSynchronize(device):
    synchronize(device)              # waits for every stream of the device: refused while one is capturing


def on_cuda_stream_per_thread(fn, device):
    """``fn`` on the calling thread's own stream (``cudaStreamPerThread``), then ``cudaStreamSynchronize`` of it."""
    errors = []

    def thread_body():
        try:
            if torch.device(device).type == "cuda":
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    fn()
                s.synchronize()
            else:
                fn()
        except Exception as e:  # noqa: BLE001 - re-raised on the caller's side
            errors.append(e)
    t = threading.Thread(target=thread_body)
    t.start()
    t.join()
    if errors:
        raise errors[0]


class ggml_backend_cuda_buffer_context:
    def __init__(self, dev_ptr, device, variant):
        self.dev_ptr, self.device, self.variant = dev_ptr, device, variant


def ggml_backend_cuda_buffer_clear(buffer: ggml_backend_cuda_buffer_context, value: float):
    if buffer.variant == "fix":       # #14033: only this thread's stream
        on_cuda_stream_per_thread(lambda: buffer.dev_ptr.fill_(value), buffer.device)   # cudaMemsetAsync + sync
        return
    cudaDeviceSynchronize(buffer.device)
    buffer.dev_ptr.fill_(value)       # cudaMemset (legacy stream)
    cudaDeviceSynchronize(buffer.device)


class llama_model:
    def __init__(self, device):
        gen = generator(14033)
        self.tok_embd = randn(N_VOCAB, N_EMBD, gen=gen, device=device)
        self.wq, self.wk, self.wv = (randn(N_EMBD, N_EMBD, gen=gen, device=device, scale=0.7) for _ in range(3))
        self.output = randn(N_EMBD, N_VOCAB, gen=gen, device=device)


class llama_kv_cache_unified:
    def __init__(self, device, variant, gen):
        # one backend buffer holding k_l and v_l; it still holds an earlier conversation
        self.buf = ggml_backend_cuda_buffer_context(randn(2, N_CTX, N_EMBD, gen=gen, device=device), device, variant)
        self.k_l, self.v_l = self.buf.dev_ptr[0], self.buf.dev_ptr[1]

    def clear(self):
        ggml_backend_cuda_buffer_clear(self.buf, 0)


class ggml_backend_cuda_context:
    """One session's backend: its stream's graph (``cuda_graph``), the decode graph's input tensors."""

    def __init__(self, name, model, kv, device, use_cuda_graph):
        self.name, self.model, self.kv, self.device = name, model, kv, device
        self.use_cuda_graph, self.number_consecutive_evals = use_cuda_graph, 0
        self.cuda_graph = None        # (graph, outputs)
        self.inp_tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.inp_pos = torch.zeros(1, dtype=torch.long, device=device)

    def evaluate_nodes(self):
        """The ggml graph of one decode step, node by node (``ggml_cuda_compute_forward``)."""
        m, kv = self.model, self.kv
        x = m.tok_embd.index_select(0, self.inp_tokens)                  # GET_ROWS
        kv.k_l.index_copy_(0, self.inp_pos, x @ m.wk)                    # CPY into the cache
        kv.v_l.index_copy_(0, self.inp_pos, x @ m.wv)
        yield_to_other_threads()                                         # evaluating takes a while
        kq = torch.softmax((x @ m.wq) @ kv.k_l.T / math.sqrt(N_EMBD), dim=-1)
        return (x + kq @ kv.v_l) @ m.output                              # result_output


def ggml_backend_cuda_graph_compute(cuda_ctx: ggml_backend_cuda_context):
    if not cuda_ctx.use_cuda_graph or cuda_ctx.number_consecutive_evals < WARMUP:
        cuda_ctx.number_consecutive_evals += 1
        return cuda_ctx.evaluate_nodes()                                 # evaluated directly
    if cuda_ctx.cuda_graph is None:   # cuda_graph_update_required: cudaStreamBeginCapture .. cudaStreamEndCapture
        cuda_ctx.cuda_graph = capture(
            cuda_ctx.evaluate_nodes, device=cuda_ctx.device, warmups=0, name=cuda_ctx.name,
            owner=f"ggml_backend_cuda_context {cuda_ctx.name}",
            static={"inp_tokens": cuda_ctx.inp_tokens, "inp_pos": cuda_ctx.inp_pos},
            state={"k_l": cuda_ctx.kv.k_l, "v_l": cuda_ctx.kv.v_l})
    g, out = cuda_ctx.cuda_graph
    return replay(g, out)                                                # cudaGraphLaunch


def llama_decode(cuda_ctx, token, pos):
    cuda_ctx.inp_tokens.copy_(torch.tensor([token]).to(cuda_ctx.device))  # ggml_backend_tensor_set
    cuda_ctx.inp_pos.copy_(torch.tensor([pos]).to(cuda_ctx.device))
    return ggml_backend_cuda_graph_compute(cuda_ctx).clone()


def run(variant: str, device: str = "cpu"):
    gen = generator(64)
    tokens_a = torch.randint(0, N_VOCAB, (STEPS_A,), generator=gen).tolist()
    tokens_b = torch.randint(0, N_VOCAB, (STEPS_B,), generator=gen).tolist()

    def serve(use_cuda_graph: bool):
        OTHER_THREADS.clear()
        model = llama_model(device)
        kv_gen = generator(13990)
        ctx_a = ggml_backend_cuda_context("session A", model, llama_kv_cache_unified(device, variant, kv_gen),
                                          device, use_cuda_graph)
        ctx_b = ggml_backend_cuda_context("session B", model, llama_kv_cache_unified(device, variant, kv_gen),
                                          device, use_cuda_graph)
        ctx_a.kv.clear()
        outs = []
        for pos, token in enumerate(tokens_a):
            if pos == WARMUP:         # session B's thread starts a new conversation during A's first capture
                OTHER_THREADS.append(ctx_b.kv.clear)
            outs.append(llama_decode(ctx_a, token, pos))
            yield_to_other_threads()
        for pos, token in enumerate(tokens_b):
            outs.append(llama_decode(ctx_b, token, pos))
        return outs

    return compare(__name__.rsplit(".", 1)[-1], variant, device, lambda: serve(True), lambda: serve(False))
