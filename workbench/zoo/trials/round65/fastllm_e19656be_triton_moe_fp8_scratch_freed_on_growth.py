"""A larger decode batch regrows the Triton FP8 MoE scratch and frees the buffers smaller-batch graphs still use.

Upstream: https://github.com/ztxz16/fastllm/commit/e19656bed01c8ec3437b1a9af84f3d08db52d79a ("修复 Triton FP8 算子兼容
CUDA Graph", i.e. "make the Triton FP8 operators compatible with CUDA Graph"; a direct commit, no PR or issue).
Read: ``git show e19656be`` (``src/devices/cuda/fastllm-triton-cuda.cu``) and, at that commit,
``src/models/qwen3_5.cpp`` (``PreCaptureCudaGraphAfterWarmup``, ``Qwen35PreCaptureBatches``, the decode-graph flow).
Symptom: no public report. Qwen3.5 MoE (FP8 experts, Triton merge-MoE path) with ``cudaGraph`` on: once the
pre-capture has gone on to a larger batch, replaying a smaller batch's decode graph reads and writes freed
scratch (illegal memory access, or garbage MoE output once the memory is handed to another allocation).
Mechanism: ``LaunchTritonMergeMOEFP8E4M3Table`` asks ``EnsureTritonMoeFp8Scratch`` (host code, run each call) for
the process-global ``g_tritonMoeFp8Scratch[deviceId]`` (``TritonMoeFp8Scratch``: ``expertCounts``,
``expertOffsets``, ``sortedTasks``, ``inputQuant``, ``inputScale``, ``gateUp``, ``activationQuant``, ``downOutput``
... each with a ``*Capacity``), then launches the route/quant/grouped-GEMM kernels on those raw pointers. When a
capacity is too small it calls ``FreeTritonScratchPtr`` and ``FastllmCudaMalloc``s the exact new size.
``PreCaptureCudaGraphAfterWarmup`` walks ``Qwen35PreCaptureBatches`` in ascending order (1, 2, 4, ...); each batch
is warmed (``runWithoutGraph``) and then captured (``runGraphBody`` between Begin/EndCapture), and the captured
kernel nodes keep the scratch addresses of that moment. The warmup of the next, larger batch needs more
``sortedTasks``/``inputQuant``/``gateUp``/... and frees the buffers the previous graph was captured with. Replays
run no host code, so nothing re-validates them: the batch-1 graph reads freed memory at the next batch-1 step.
(The commit's second half, the ``cudaMemcpy`` of ``totalBlocks`` that sizes the grid inside the capture, is left
out: here the launch always uses the upper-bound grid, as with ``FASTLLM_CUDA_TRITON_MERGE_MOE_HOST_BLOCKS=0``.)
Doctor: dangling-reference, at ``EnsureTritonMoeFp8Scratch`` (it frees scratch storage that earlier captured
graphs still reference, on growth for a larger batch).
Fix (upstream): ``GrowTritonScratchPtr`` / ``ReleaseOrRetainTritonScratchPtr``: with ``GetFastllmEnv().cudaGraph``
(``PreserveTritonScratchAddresses``) the old pointer is not freed but pushed to the new
``TritonMoeFp8Scratch::retiredPointers`` ("Captured graphs keep the scratch addresses embedded in their kernel
nodes. Preserve old generations in graph mode"), and capacities grow geometrically (``NextTritonScratchCapacity``
doubles) so the retained generations stay small.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine import events
from workbench.zoo.kit import (capture, compare, generator, own_segment_elems, randn, release_to_driver,
                               replay)

UPSTREAM = "https://github.com/ztxz16/fastllm/commit/e19656bed01c8ec3437b1a9af84f3d08db52d79a"
FAMILY = "dangling references"
KIND = "dangling-reference"
SITE = "EnsureTritonMoeFp8Scratch"
SYMPTOM = "after the batch-2/4 warmups regrow the FP8 MoE scratch, the batch-1 decode graph reads freed scratch"

HIDDEN, INTER, EXPERTS, TOPK, VOCAB = 8, 6, 4, 2, 10
GROUP_BLOCK_M = 2                      # groupBlockM of the grouped GEMM
FP8_E4M3_MAX = 448.0
PRECAPTURE_BATCHES = (1, 2, 4)         # Qwen35PreCaptureBatches(4): geometric, sorted ascending
SCHEDULE = (1, 4, 2, 1, 4, 2, 1)       # decode batch of each served step


class FastllmEnv:
    cudaGraph = True


def GetFastllmEnv():
    return FastllmEnv


def FastllmCudaMalloc(elements, dtype, device):
    """An exact-size device allocation. On CUDA it gets a segment of its own whose size grows with the
    request (512 bytes an element), so a regrown buffer cannot land in the block just freed, and a freed
    block nobody took is unmapped by ``release_to_driver``: a replay that still uses it faults."""
    padded = own_segment_elems(device) + 128 * elements if torch.device(device).type == "cuda" else elements
    return torch.zeros(padded, dtype=dtype, device=device)[:elements]


class TritonMoeFp8Scratch:
    # (pointer, capacity field, dtype) of the buffers regrown with the work size
    GROWN = (("sortedTasks", "taskCapacity", torch.int32), ("inputQuant", "inputQuantCapacity", torch.float32),
             ("inputScale", "inputScaleCapacity", torch.float32), ("gateUp", "gateUpCapacity", torch.float32),
             ("activationQuant", "activationQuantCapacity", torch.float32),
             ("downOutput", "downOutputCapacity", torch.float32))

    def __init__(self):
        self.expertCapacity = 0
        self.expertCounts = self.expertOffsets = None
        for ptr, cap, _ in self.GROWN:
            setattr(self, ptr, None)
            setattr(self, cap, 0)
        self.retiredPointers = []       # the fix: old generations kept alive in graph mode


g_tritonMoeFp8Scratch: dict = {}


def FreeTritonScratchPtr(cached, ptr):
    setattr(cached, ptr, None)         # FastllmCudaFree: the scratch was the buffer's only owner


def ReleaseOrRetainTritonScratchPtr(cached, ptr):
    if getattr(cached, ptr) is None:
        return
    if GetFastllmEnv().cudaGraph:      # captured graphs keep the addresses: preserve old generations
        cached.retiredPointers.append(getattr(cached, ptr))
        setattr(cached, ptr, None)
    else:
        FreeTritonScratchPtr(cached, ptr)


def NextTritonScratchCapacity(current, required):
    if current <= 0:
        return required
    doubled = current * 2
    return doubled if doubled > required else required


def GrowTritonScratchPtr(cached, ptr, cap, required, dtype, device):
    if getattr(cached, cap) >= required and getattr(cached, ptr) is not None:
        return
    new_capacity = NextTritonScratchCapacity(getattr(cached, cap), required)
    replacement = FastllmCudaMalloc(new_capacity, dtype, device)
    ReleaseOrRetainTritonScratchPtr(cached, ptr)
    setattr(cached, ptr, replacement)
    setattr(cached, cap, new_capacity)


def EnsureTritonMoeFp8Scratch(experts, required, device, variant):
    """``required``: capacity field -> elements this call needs. Runs on the host at every call: at
    warmups and captures, never at replays."""
    cached = g_tritonMoeFp8Scratch.setdefault(device, TritonMoeFp8Scratch())
    if cached.expertCapacity < experts:
        cached.expertCapacity = experts
        cached.expertCounts = FastllmCudaMalloc(experts, torch.int32, device)
        cached.expertOffsets = FastllmCudaMalloc(experts + 1, torch.int32, device)
    for ptr, cap, dtype in TritonMoeFp8Scratch.GROWN:
        if variant == "bug":
            if getattr(cached, cap) < required[cap]:          # free, then malloc the exact new size
                FreeTritonScratchPtr(cached, ptr)
                setattr(cached, cap, required[cap])
                setattr(cached, ptr, FastllmCudaMalloc(required[cap], dtype, device))
        else:
            GrowTritonScratchPtr(cached, ptr, cap, required[cap], dtype, device)
    return cached


class TritonMoeFp8ExpertTable:
    """The packed per-expert weights (``packedGateWeights`` [E, H, 2I], ``packedDownWeights`` [E, I, H])."""

    def __init__(self, gen, device):
        self.experts = EXPERTS
        self.packedGateWeights = randn(EXPERTS, HIDDEN, 2 * INTER, gen=gen, device=device, scale=0.4)
        self.packedDownWeights = randn(EXPERTS, INTER, HIDDEN, gen=gen, device=device, scale=0.4)


def LaunchTritonMergeMOEFP8E4M3Table(input, indices, scores, batch, topk, table, variant):
    device = str(input.device)
    totalTasks = batch * topk
    maxLaunchBlocksArg = (totalTasks + table.experts * (GROUP_BLOCK_M - 1) + GROUP_BLOCK_M - 1) // GROUP_BLOCK_M
    sortedTaskCapacity = maxLaunchBlocksArg * GROUP_BLOCK_M
    scratch = EnsureTritonMoeFp8Scratch(table.experts, {
        "taskCapacity": sortedTaskCapacity, "inputQuantCapacity": batch * HIDDEN, "inputScaleCapacity": batch,
        "gateUpCapacity": totalTasks * INTER * 2, "activationQuantCapacity": totalTasks * INTER,
        "downOutputCapacity": totalTasks * HIDDEN}, device, variant)
    output = torch.empty(batch, HIDDEN, device=input.device)        # output.Allocate()
    flat = indices.reshape(-1)
    # merge_moe_fp8_init_count / prefix / fill_sorted: group the (token, k) tasks by expert
    experts = torch.arange(table.experts, device=input.device, dtype=flat.dtype)
    scratch.expertCounts.copy_((flat[:, None] == experts).sum(0))
    scratch.expertOffsets[:1].zero_()
    scratch.expertOffsets[1:].copy_(scratch.expertCounts.cumsum(0))
    scratch.sortedTasks[:totalTasks].copy_(torch.sort(flat, stable=True).indices)
    # per-token FP8 quantisation of the input
    inputScale = scratch.inputScale[:batch]
    inputScale.copy_(input.abs().amax(-1).clamp(min=1e-6) / FP8_E4M3_MAX)
    inputQuant = scratch.inputQuant[:batch * HIDDEN].view(batch, HIDDEN)
    inputQuant.copy_(input / inputScale[:, None])
    # grouped gate-up GEMM over the sorted tasks (upper-bound grid: maxLaunchBlocksArg blocks)
    task = scratch.sortedTasks[:totalTasks].long()
    token, expert = task // topk, flat[task].long()
    x = (inputQuant[token] * inputScale[token, None])[:, None, :]
    gateUp = scratch.gateUp[:totalTasks * INTER * 2].view(totalTasks, 2 * INTER)
    gateUp.copy_(torch.bmm(x, table.packedGateWeights[expert]).squeeze(1))
    activation = scratch.activationQuant[:totalTasks * INTER].view(totalTasks, INTER)
    activation.copy_(F.silu(gateUp[:, :INTER]) * gateUp[:, INTER:])
    downOutput = scratch.downOutput[:totalTasks * HIDDEN].view(totalTasks, HIDDEN)
    downOutput.copy_(torch.bmm(activation[:, None, :], table.packedDownWeights[expert]).squeeze(1))
    # merge: weight each task's row by its routing score, sum per token
    weighted = downOutput * scores.reshape(-1)[task][:, None]
    return output.zero_().index_add_(0, token, weighted)


class Qwen35CudaGraphDecodeState:
    def __init__(self, batch, device):
        self.warmed = self.captured = False
        self.graph = self.logits = None
        self.inputIds = torch.zeros(batch, HIDDEN, device=device)    # static decode input (embedded here)


class Qwen3_5Model:
    def __init__(self, device, variant):
        gen = generator(1965)
        self.device, self.variant = device, variant
        self.router = randn(HIDDEN, EXPERTS, gen=gen, device=device)
        self.table = TritonMoeFp8ExpertTable(gen, device)
        self.lm_head = randn(HIDDEN, VOCAB, gen=gen, device=device, scale=0.5)
        self.states: dict = {}

    def runGraphBody(self, hidden):
        probs = torch.softmax(hidden @ self.router, dim=-1)
        expertScore, expertIndex = probs.topk(TOPK, dim=-1)
        expertIndex = expertIndex.to(torch.int32)
        moe = LaunchTritonMergeMOEFP8E4M3Table(hidden, expertIndex, expertScore, hidden.shape[0], TOPK,
                                               self.table, self.variant)
        return (hidden + moe) @ self.lm_head

    def ForwardDecode(self, hidden):
        batch = hidden.shape[0]
        state = self.states.setdefault(batch, Qwen35CudaGraphDecodeState(batch, self.device))
        state.inputIds.copy_(hidden)
        if state.captured:
            return replay(state.graph, state.logits).clone()
        if not state.warmed:                                      # runWithoutGraph()
            with events.warmup():
                logits = self.runGraphBody(state.inputIds)
            state.warmed = True
            return logits.clone()
        state.graph, state.logits = capture(                      # Begin/EndCapture around runGraphBody()
            lambda: self.runGraphBody(state.inputIds), device=self.device, warmups=0,
            name=f"qwen3.5 decode batch {batch}", static={"inputIds": state.inputIds},
            owner="Qwen3.5 CUDA graph decode (fastllm)")
        state.captured = True
        return replay(state.graph, state.logits).clone()          # first launch

    def PreCaptureCudaGraphAfterWarmup(self):
        gen = generator(4)
        for batch in PRECAPTURE_BATCHES:
            dummy = randn(batch, HIDDEN, gen=gen, device=self.device)
            self.ForwardDecode(dummy)                             # warmup
            self.ForwardDecode(dummy)                             # capture + first launch


def run(variant: str, device: str = "cpu"):
    gen = generator(19656)
    steps = [randn(b, HIDDEN, gen=gen, device=device) for b in SCHEDULE]

    def eager():
        g_tritonMoeFp8Scratch.clear()
        model = Qwen3_5Model(device, variant)
        return [model.runGraphBody(x).clone() for x in steps]

    def served():
        g_tritonMoeFp8Scratch.clear()
        model = Qwen3_5Model(device, variant)
        model.PreCaptureCudaGraphAfterWarmup()
        release_to_driver(device)           # the serving process hands cached blocks back
        return [model.ForwardDecode(x) for x in steps]

    return compare(__name__.rsplit(".", 1)[-1], variant, device, served, eager)
