"""TensorRT-LLM's ``torch.ops.trtllm.cublas_mm`` freed its cuBLASLt workspace at every return; captured GEMMs kept it.

TensorRT-LLM's PyTorch backend serves generation steps from CUDA graphs: ``CUDAGraphRunner`` warms each batch size up
twice, captures it (largest first, every graph into one shared memory pool) and replays it; the overlap scheduler
enqueues the next iteration's forward before it processes the previous iteration's outputs. Since #13160, on SM121
(DGX Spark) Nemotron-H routes ``UnquantizedLinearMethod.apply`` to ``torch.ops.trtllm.cublas_mm``, whose C++
``cublas_gemm_caller`` allocated ``torch::empty(CUBLAS_WORKSPACE_SIZE)`` (32 MiB) on every call, bound it to the
cuBLASLt wrapper (``setWorkspace``) and let it destruct at return. Inside a capture the GEMM keeps the workspace's
address; the block goes back to the caching allocator (the graph pool) and is handed to a later allocation while
every replay still writes and reads its split-K scratch there. The fix keeps one persistent workspace per stream.

Upstream: https://github.com/NVIDIA/TensorRT-LLM/pull/15534 ("[https://nvbugs/6150288][fix] Use persistent
per-stream workspace in cublas_mm for CUDA-graph safety", NVIDIA/TensorRT-LLM, author pamelap-nvidia, description
dated 2026-06-23, merged; commit 93fa1e0483, listed 2026-06-30 in a stored change log with the one file
``cpp/tensorrt_llm/thop/cublasScaledMM.cpp``). Read: the PR's description (its "Fix" section cut off in the stored
text after "Replace the per-call allocation with a per-st..."); the fix's hunk as quoted in a review thread
(``thread_local std::unordered_map<cudaStream_t, at::Tensor> workspace_cache; auto stream_ptr = stream.stream();
auto& workspace = workspace_cache[stream_ptr]; if (!workspace.defined() || workspace.device() != a.device())
workspace = torch::empty(CUBLAS_WORKSPACE_SIZE, workspace_options);``, "Keyed by (device, stream) so that concurrent
GEMMs on different streams don't race on the same scratch bytes. Mirrors PyTorch's per-stream cublasLt workspace
cache"); ``cublasScaledMM.cpp`` before the fix in two stored versions (``cublas_gemm_caller``: the thread_local
``CublasMMWrapper``, the per-call ``torch::empty`` workspace, ``setStream``, ``setWorkspace``,
``find_special_algo``, ``createDescriptors``, ``Gemm``; ``cublas_mm``, which allocates ``out`` with ``at::empty``
and calls ``cublas_mm_out``, which calls ``cublas_gemm_caller``); ``UnquantizedLinearMethod.apply`` in
``_torch/modules/linear.py`` (``torch.ops.trtllm.cublas_mm(input, module.weight.t(), bias, out_dtype=None)`` when
``module.use_custom_cublas_mm``); an older ``DecodingCUDAGraphRunner.capture`` (two warmup runs, ``torch.cuda.graph``
into the shared pool, ``make_weak_ref(output)``); for the runner and the overlap consumer, the header of this zoo's
``trtllm_17010`` program (#17010: ``CUDAGraphRunner.capture`` keeps each output as a weak ref only, until
Jul/Aug 2026). Not read: the diff page itself, #13160, the bug's YAML, ``CublasMMWrapper``'s source, the current
``CUDAGraphRunner`` and ``PyExecutor``, Nemotron-H's modules and ``FusedMoeRunner::getWorkspaceInfo``.
Symptom: Nemotron-3-Nano-Omni-30B-A3B-Reasoning-NVFP4 on DGX Spark (SM121) with CUDA graphs segfaulted in
``FusedMoeRunner::getWorkspaceInfo`` on the second generation-only CUDA-graph warmup; the PR reads it as
"free-block-tree corruption on the next allocator operation" after a use-after-free ("the underlying
graph-unsafety is not" Spark-specific). Without CUDA graphs the per-call workspace is safe: the GEMM is enqueued
before the block is freed, and stream order protects it.
Mechanism: at capture ``cublas_gemm_caller`` allocates the workspace from the graph's pool, the captured cuBLASLt
GEMM bakes its address in, and the tensor is destroyed at return: the pool block is free while the graph still uses
it. The next capture into the shared pool (the next, smaller batch size) is handed that block for a tensor of its
own; here ``cublas_mm``'s output of the smaller graph's ``lm_head``, the logits that graph hands out. From then on
every replay of the larger graph writes its split-K partial products over those logits. With the overlap scheduler
the previous iteration's logits (smaller batch) are read after the next iteration's forward (larger batch) was
replayed: their log-probs come out wrong. (Which tensor lands in the block, and that it is read across the other
graph's replay, is this program's workload: upstream reports an allocator crash and names no tensor. A block freed
inside a capture goes only to later allocations of captures into the same pool, so the harm needs such a tensor
that lives across a replay of the first graph; scratch landing there would be harmless.)
Doctor: dangling-reference, at ``cublas_gemm_caller``: the captured GEMM reads (and writes) its workspace after the
workspace's owner, ``cublas_gemm_caller``'s local tensor, released it to the allocator, which gave it to another
tensor; ``cublas_gemm_caller`` makes the workspace, hands its address to the captured GEMM and drops it, and is the
one function the fix changes. The victim read (``_process_previous_batch`` reading handed-out logits after the other
graph's replay) is where it shows, as in ``trtllm_17010`` (overwritten-output there, where the runner itself let the
output block go).
Fix (upstream): ``cublas_gemm_caller`` takes the workspace from a ``thread_local`` ``workspace_cache`` keyed by the
stream, allocating it only when missing (or on another device), so the workspace lives for the process and no
allocation can be placed in it.
Modelled: ``cublas_gemm_caller`` (bug: per-call ``torch.empty`` workspace; fix: ``workspace_cache``),
``cublas_mm``/``cublas_mm_out``, ``CublasMMWrapper`` (``setStream``, ``setWorkspace``, ``Gemm``), ``Linear`` with
``UnquantizedLinearMethod.apply`` (``use_custom_cublas_mm``), Nemotron-H's ``MLP`` (``relu2``), ``CUDAGraphRunner``
(``capture``: two warmups, one shared ``memory_pool``, outputs kept through ``make_weak_ref``; ``replay``),
``make_weak_ref`` and ``PyExecutor._process_previous_batch``.
Stand-ins: cuBLASLt's GEMM is a split-K algorithm that writes ``SPLIT_K`` partial products into the workspace and
reduces them into ``out`` (cuBLAS picks split-K plus reduce for small-M decode GEMMs, per a TensorRT-LLM comment);
the heuristic (``find_special_algo`` / cuBLASLt's own) is "split-K when the partials fit the workspace".
``setWorkspace`` keeps a weak reference (C++: a raw pointer), and so does ``make_weak_ref``.
``CUBLAS_WORKSPACE_SIZE`` is 384 bytes (48 float64), not 32 MiB, sized so that the smaller graph's logits fill the
freed block exactly (the emulation's pool hands a free block to an allocation of the same byte size; the real
allocator places by best fit). One stream: the warmup and capture streams are one key (upstream,
``torch.cuda.graph`` captures on its own stream, so the fixed cache makes a second workspace at the first capture,
kept by the cache: never freed either). The model is an embedding, one Nemotron-H MLP block with a residual and an
``lm_head``, all unquantized float64 Linears through ``cublas_mm``; no mamba, attention, MoE or NVFP4; the
sampler is greedy and the "log-probs" are those of the sampled tokens, computed eagerly from the handed-out logits.
Workload: vocab 24, hidden 4, intermediate 10; graphs for batch sizes 4 and 2 (captured in that order); five
generation iterations with batch sizes 4, 2, 4, 2, 4; outputs: each iteration's sampled tokens and log-probs.
Measured: the check's two outcomes (``Outcome.summary()``; the check printed their reprs, max_abs_error 3.245 and 0.0):
  trtllm_15534_cublas_mm_per_call_workspace_freed_under_captured_gemm [bug] on cpu: misbehaves (max |graph - eager|
  = 3.25)
  trtllm_15534_cublas_mm_per_call_workspace_freed_under_captured_gemm [fix] on cpu: equals eager (max |graph -
  eager| = 0)
Only the log-probs of the two batch-2 iterations are wrong (off by 2.57 and 3.25; read after a batch-4 replay whose
down_proj GEMM wrote its split-K partials over them); every token is right (sampled before that replay). Both
variants together in about 4 s on the CPU, imports included.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.engine import graph_pool_handle
from workbench.zoo.kit import capture, compare, generator, randn, replay

UPSTREAM = "https://github.com/NVIDIA/TensorRT-LLM/pull/15534"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "cublas_gemm_caller"
SYMPTOM = ("captured cublas_mm GEMMs keep writing split-K scratch into a workspace freed at capture, which the shared "
           "graph pool handed to another batch size's logits: log-probs of those logits come out wrong")

VOCAB, HIDDEN, INTERMEDIATE = 24, 4, 10
CUDA_GRAPH_BATCH_SIZES = [4, 2]                 # captured largest first, into one pool
ITERATION_BATCH_SIZES = [4, 2, 4, 2, 4]
CUBLAS_WORKSPACE_SIZE = 384                     # bytes (upstream 32 MiB)
SPLIT_K = 2
_variant = "bug"
workspace_cache: dict = {}                      # thread_local std::unordered_map<cudaStream_t, at::Tensor>


# --- tensorrt_llm/_torch/utils.py ------------------------------------------------------------------------------------

class _WeakRefTensor:
    """``make_weak_ref``: the output's address, not its ownership."""

    def __init__(self, t):
        self._meta = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.is_cuda:
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                             "typestr": "<f8", "version": 2}
        else:
            self._ref = StorageWeakRef(t.untyped_storage())

    def tensor(self):
        offset, shape, stride, dtype, device = self._meta
        if device.type == "cuda":
            return torch.as_tensor(self, device=device).view(dtype)
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def make_weak_ref(x):
    return _WeakRefTensor(x)


# --- cpp/tensorrt_llm/thop/cublasScaledMM.cpp ---------------------------------------------------------------------

class CublasMMWrapper:
    """``tensorrt_llm::common::CublasMMWrapper``: the stream and workspace the next cuBLASLt call uses."""

    def __init__(self):
        self.stream, self.workspace = None, None

    def setStream(self, stream):
        self.stream = stream

    def setWorkspace(self, ws_ptr):
        self.workspace = make_weak_ref(ws_ptr)      # a raw void*: the wrapper does not own the workspace

    def Gemm(self, a, b, out):
        """``cublasLtMatmul``: split-K (partials into the workspace, then a reduction) when they fit it."""
        m, k = a.shape
        n = b.shape[1]
        workspace = self.workspace.tensor()
        partial_elems = SPLIT_K * m * n
        if partial_elems <= workspace.numel() and k % SPLIT_K == 0:
            chunk = k // SPLIT_K
            partial = workspace[:partial_elems].view(SPLIT_K, m, n)
            for s in range(SPLIT_K):
                torch.mm(a[:, s * chunk:(s + 1) * chunk], b[s * chunk:(s + 1) * chunk], out=partial[s])
            torch.sum(partial, 0, out=out)
        else:
            torch.mm(a, b, out=out)


_cublas_wrapper = None                          # thread_local std::shared_ptr<CublasMMWrapper> cublasWrapper


def getCurrentCUDAStream(device):
    return ("current stream", str(device))


def cublas_gemm_caller(out, a, b, scale_a, scale_b, bias, fast_acc=False):
    global _cublas_wrapper
    if _cublas_wrapper is None:
        _cublas_wrapper = CublasMMWrapper()
    stream = getCurrentCUDAStream(a.device)
    if _variant == "bug":
        workspace = torch.empty(CUBLAS_WORKSPACE_SIZE, dtype=torch.uint8, device=a.device)
    else:
        # Keyed by (device, stream) so that concurrent GEMMs on different streams don't race on the same scratch bytes.
        workspace = workspace_cache.get(stream)
        if workspace is None or workspace.device != a.device:
            workspace = workspace_cache[stream] = torch.empty(CUBLAS_WORKSPACE_SIZE, dtype=torch.uint8,
                                                              device=a.device)
    ws_ptr = workspace.view(out.dtype)
    _cublas_wrapper.setStream(stream)
    _cublas_wrapper.setWorkspace(ws_ptr)
    _cublas_wrapper.Gemm(a, b, out)
    if bias is not None:
        out.add_(bias)


def cublas_mm_out(mat_a, mat_b, bias, out):
    assert mat_a.dim() == 2 and mat_b.dim() == 2 and out.dim() == 2
    cublas_gemm_caller(out, mat_a, mat_b, None, None, bias, False)
    return out


def cublas_mm(mat_a, mat_b, bias=None, out_dtype=None):
    """``torch.ops.trtllm.cublas_mm``."""
    out = torch.empty(mat_a.shape[0], mat_b.shape[1], dtype=out_dtype or mat_a.dtype, device=mat_a.device)
    return cublas_mm_out(mat_a, mat_b, bias, out)


# --- tensorrt_llm/_torch: modules, model, CUDA graph runner, executor -------------------------------------------------

class UnquantizedLinearMethod:
    def apply(self, module, input, bias):
        if module.use_custom_cublas_mm:
            output = cublas_mm(input, module.weight.t(), bias, out_dtype=None)
        else:
            output = torch.nn.functional.linear(input, module.weight, bias)
        return output


class Linear:
    def __init__(self, in_features, out_features, gen, device, scale):
        self.weight = randn(out_features, in_features, gen=gen, device=device, scale=scale).double()
        self.bias = None
        self.use_custom_cublas_mm = True        # #13160: Nemotron-H on SM121
        self.quant_method = UnquantizedLinearMethod()

    def __call__(self, input):
        return self.quant_method.apply(self, input, self.bias)


def relu2(x):
    return torch.square(torch.relu(x))


class MLP:
    def __init__(self, gen, device):
        self.up_proj = Linear(HIDDEN, INTERMEDIATE, gen, device, 0.5)
        self.down_proj = Linear(INTERMEDIATE, HIDDEN, gen, device, 0.4)

    def __call__(self, x):
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHForCausalLM:
    def __init__(self, device):
        gen = generator(15534)
        self.embed_tokens = randn(VOCAB, HIDDEN, gen=gen, device=device).double()
        self.mlp = MLP(gen, device)
        self.lm_head = Linear(HIDDEN, VOCAB, gen, device, 0.7)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens[input_ids]
        hidden_states = hidden_states + self.mlp(hidden_states)
        return self.lm_head(hidden_states)                      # logits: cublas_mm's output


class CUDAGraphRunner:
    def __init__(self, device):
        self.device = device
        self.graphs, self.graph_outputs = {}, {}
        self.memory_pool = graph_pool_handle(device)
        self.input_ids = torch.zeros(max(CUDA_GRAPH_BATCH_SIZES), dtype=torch.long, device=device)

    def capture(self, key, forward_fn):
        bs = key
        g, output = capture(lambda: forward_fn(self.input_ids[:bs]), device=self.device, pool=self.memory_pool,
                            warmups=2, name=f"bs {bs}", static={"input_ids": self.input_ids},
                            owner="CUDAGraphRunner")
        self.graphs[key] = g
        # Mark weak ref here. The output tensor should be freed properly.
        self.graph_outputs[key] = make_weak_ref(output)
        del output

    def replay(self, key, input_ids):
        self.input_ids[:key].copy_(input_ids)
        return replay(self.graphs[key], self.graph_outputs[key].tensor())


def _process_previous_batch(previous):
    """Overlap scheduler: the previous iteration's log-probs of its sampled tokens, computed after the next
    iteration's forward was enqueued."""
    logits, tokens = previous
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1).clone()


def run(variant: str, device: str = "cpu"):
    global _variant, _cublas_wrapper
    gen = torch.Generator().manual_seed(6150288)
    batches = [torch.randint(0, VOCAB, (bs,), generator=gen).to(device) for bs in ITERATION_BATCH_SIZES]

    def loop(forward):
        outs, previous = [], None
        for input_ids in batches:
            logits = forward(input_ids)
            tokens = logits.argmax(-1)
            outs.append(tokens.clone())
            if previous is not None:
                outs.append(_process_previous_batch(previous))
            previous = (logits, tokens)
        outs.append(_process_previous_batch(previous))
        return outs

    def fresh_process():
        global _cublas_wrapper
        workspace_cache.clear()
        _cublas_wrapper = None

    def eager():
        fresh_process()
        model = NemotronHForCausalLM(device)
        return loop(model.forward)

    def served():
        fresh_process()
        model = NemotronHForCausalLM(device)
        runner = CUDAGraphRunner(device)
        for bs in CUDA_GRAPH_BATCH_SIZES:
            runner.capture(bs, model.forward)
        return loop(lambda input_ids: runner.replay(input_ids.shape[0], input_ids))

    _variant = variant
    try:
        return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
    finally:
        _variant = "bug"
        workspace_cache.clear()
        _cublas_wrapper = None
